"""How much cache a set of processes taking turns on one core keeps, on this host.

Run: ``python bench/cache_ring.py [--kb 160] [--counts 1,2,5,10,20,30,60,100] [--cpu 1]``
(needs ``gcc``).

Per-guild workers mean that N guilds called round robin are N processes
taking turns on the cores, each touching its own memory (reference counts,
its heap) between two of its jobs. Whether a worker finds that memory still
in the cache depends on the host, not on this project: how much of the
last-level cache the virtual machine really gets, shared with its
neighbours. This bench measures it with no Python in the way: N processes
pinned to one CPU pass a token round a ring of pipes; on each turn a process
reads and writes one byte of each of the ``--kb`` KiB of its own memory's
cache lines, in a shuffled order (as a Python job's scattered objects are).
It prints the time per cache line for each N: flat while the N working sets
fit in what the cache keeps for them, then ~10x more once they do not. N x
``--kb`` at the knee is the cache the host gives to processes taking turns.
A worker's job touches ~160 KB of data of its own (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int n = atoi(argv[1]), kb = atoi(argv[2]);
    int turns = 20000 / n + 200, skip = 100, lines = kb * 1024 / 64;
    int (*ring)[2] = malloc(sizeof(int[2]) * (n + 1));
    int (*out)[2] = malloc(sizeof(int[2]));
    for (int i = 0; i <= n; i++) if (pipe(ring[i])) return 1;
    if (pipe(out[0])) return 1;
    for (int w = 0; w < n; w++) {
        if (fork() != 0) continue;
        char *mem = mmap(0, (size_t)lines * 64, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        int *order = malloc(sizeof(int) * lines);
        double *took = malloc(sizeof(double) * turns);
        for (int i = 0; i < lines; i++) order[i] = i;
        srand(w + 1);
        for (int i = lines - 1; i > 0; i--) {
            int j = rand() % (i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (int i = 0; i < lines; i++) mem[(size_t)order[i] * 64] = 1;
        char c;
        for (int t = 0; t < turns; t++) {
            if (read(ring[w][0], &c, 1) != 1) _exit(1);
            double t0 = now_ns();
            volatile long sum = 0;
            for (int i = 0; i < lines; i++) {
                char *p = mem + (size_t)order[i] * 64;
                sum += *p;
                *p = (char)sum;
            }
            took[t] = now_ns() - t0;
            if (write(ring[w + 1][1], &c, 1) != 1) _exit(1);
        }
        if (w == 0) {
            qsort(took + skip, turns - skip, sizeof(double), cmp);
            double median = took[skip + (turns - skip) / 2];
            if (write(out[0][1], &median, sizeof median) != sizeof median) _exit(1);
        }
        _exit(0);
    }
    char c = 'x';
    for (int t = 0; t < turns; t++) {
        if (write(ring[0][1], &c, 1) != 1 || read(ring[n][0], &c, 1) != 1) return 1;
    }
    double median;
    if (read(out[0][0], &median, sizeof median) != sizeof median) return 1;
    while (wait(0) > 0) {}
    printf("%.1f %.2f\n", median / 1e3, median / lines);
    return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kb", type=int, default=160, help="KiB each process touches per turn")
    parser.add_argument("--counts", default="1,2,5,10,15,20,30,60,100",
                        help="numbers of processes taking turns")
    parser.add_argument("--cpu", type=int, default=1, help="the CPU they all run on")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ring.c", Path(tmp) / "ring"
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
        os.sched_setaffinity(0, {args.cpu})  # inherited by the ring's processes
        print(f"processes taking turns on CPU {args.cpu}, each touching {args.kb} KiB "
              "(one byte per 64-byte line, shuffled) per turn; median of its turns:")
        base = None
        for n in (int(c) for c in args.counts.split(",") if c.strip()):
            us, ns_line = (float(v) for v in subprocess.run(
                [str(exe), str(n), str(args.kb)], check=True, capture_output=True,
                text=True).stdout.split())
            base = base or ns_line
            print(f"  {n:4d} processes ({n * args.kb / 1024:6.1f} MiB in all): {us:8.1f} us a "
                  f"turn, {ns_line:6.2f} ns a line ({ns_line / base:5.1f}x one process)",
                  flush=True)


if __name__ == "__main__":
    main()
