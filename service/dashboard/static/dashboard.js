// Logic Endpoints dashboard: small enhancements over server-rendered pages.
// Loaded from the dashboard's own origin (the CSP forbids inline script).
"use strict";

(function () {
  function xsrf() {
    var meta = document.querySelector('meta[name="xsrf-token"]');
    return meta ? meta.getAttribute("content") : "";
  }

  // Times in the viewer's time zone.
  function localTimes() {
    var zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
    document.querySelectorAll("time[datetime]").forEach(function (el) {
      var d = new Date(el.getAttribute("datetime"));
      if (isNaN(d.getTime())) { return; }
      el.textContent = d.toLocaleString();
      el.setAttribute("title", zone);
    });
    document.querySelectorAll("text[data-time]").forEach(function (el) {
      var d = new Date(el.getAttribute("data-time"));
      if (isNaN(d.getTime())) { return; }
      el.textContent = el.getAttribute("data-format") === "date"
        ? d.toLocaleDateString(undefined, { month: "2-digit", day: "2-digit" })
        : d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" });
    });
  }

  // Copy buttons: data-copy="#id of a field".
  function copyButtons() {
    document.addEventListener("click", function (ev) {
      var button = ev.target.closest ? ev.target.closest("[data-copy]") : null;
      if (!button) { return; }
      var field = document.querySelector(button.getAttribute("data-copy"));
      if (!field) { return; }
      var text = field.value || field.textContent;
      var done = function () {
        var old = button.textContent;
        button.textContent = "Copied";
        var status = document.getElementById("copy-status");
        if (status && button.id === "copy-secret") { status.textContent = "Copied to the clipboard."; }
        setTimeout(function () { button.textContent = old; }, 2000);
      };
      if (navigator.clipboard && navigator.clipboard.writeText) {
        navigator.clipboard.writeText(text).then(done, function () { field.select(); });
      } else {
        field.select();
      }
    });
  }

  // Secret: confirm, POST, show once in a dialog; a reload shows only the hint.
  function secretFlow() {
    var form = document.getElementById("secret-form");
    var confirmDialog = document.getElementById("confirm-dialog");
    var secretDialog = document.getElementById("secret-dialog");
    if (!form || !confirmDialog || !secretDialog || !confirmDialog.showModal) { return; }
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      confirmDialog.showModal();
      document.getElementById("confirm-yes").focus();
    });
    document.getElementById("confirm-no").addEventListener("click", function () {
      confirmDialog.close();
      document.getElementById("secret-button").focus();
    });
    document.getElementById("confirm-yes").addEventListener("click", function () {
      var body = new URLSearchParams();
      body.set("_xsrf", xsrf());
      body.set("confirm", "yes");   // confirmed in the dialog
      body.set("replaces", document.getElementById("secret-replaces").value);
      fetch(form.getAttribute("action"), {
        method: "POST", body: body, credentials: "same-origin",
        headers: { "Accept": "application/json" }
      }).then(function (resp) {
        return resp.json().then(function (data) { return { ok: resp.ok, data: data }; });
      }).then(function (res) {
        confirmDialog.close();
        if (!res.ok) {
          alert((res.data.error && res.data.error.message) || "The secret was not changed.");
          return;
        }
        var field = document.getElementById("new-secret");
        field.value = res.data.secret;
        secretDialog.showModal();
        field.focus();
        field.select();
      }).catch(function () {
        // No answer, or not the service's (a proxy's error page, a 413):
        // whether the secret changed is unknown until the page is reloaded.
        confirmDialog.close();
        alert("No answer came from the service: reload the page to see whether the secret " +
              "was changed.");
      });
    });
    document.getElementById("secret-done").addEventListener("click", function () {
      document.getElementById("new-secret").value = "";
      secretDialog.close();
      window.location.reload();
    });
    secretDialog.addEventListener("cancel", function () {
      document.getElementById("new-secret").value = "";
      window.location.reload();
    });
  }

  // Whitelist: check each line as it is typed (the server checks again).
  function cidrProblem(line) {
    var m = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?:\/(\d{1,2}))?$/.exec(line);
    if (m) {
      for (var i = 1; i <= 4; i++) { if (+m[i] > 255) { return "is not an IPv4 address"; } }
      if (m[5] !== undefined && +m[5] > 32) { return "has a prefix over 32"; }
      return "";
    }
    var v6 = /^([0-9A-Fa-f:.]+)(?:\/(\d{1,3}))?$/.exec(line);
    if (v6 && v6[1].indexOf(":") >= 0) {
      if (v6[2] !== undefined && +v6[2] > 128) { return "has a prefix over 128"; }
      return "";
    }
    return "is not an IP address or CIDR";
  }

  function whitelist() {
    var field = document.getElementById("cidrs");
    var error = document.getElementById("cidrs-error");
    var form = document.getElementById("whitelist-form");
    if (!field || !error || !form) { return; }
    var check = function () {
      var problems = field.value.split(/[\s,]+/).filter(Boolean).map(function (line) {
        var why = cidrProblem(line);
        return why ? line + " " + why : "";
      }).filter(Boolean);
      error.textContent = problems.join("; ");
      if (problems.length) { field.setAttribute("aria-invalid", "true"); }
      else { field.removeAttribute("aria-invalid"); }
      return problems.length === 0;
    };
    field.addEventListener("input", check);
    form.addEventListener("submit", function (ev) {
      if (!check()) { ev.preventDefault(); field.focus(); }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    localTimes();
    copyButtons();
    secretFlow();
    whitelist();
    var result = document.getElementById("console-result") || document.getElementById("console-error");
    if (result) { result.setAttribute("tabindex", "-1"); result.focus(); }
  });
})();
