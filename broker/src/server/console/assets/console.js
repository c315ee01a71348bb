// cgx console: the one script. Pages work without it; with it, a live page (main[data-live])
// refreshes its content in place. It polls the page's own URL with If-None-Match (a 304 moves
// a few bytes), backs off while nothing changes (2 s, ×1.5, to 30 s) and on errors (×2, to
// 60 s), and pauses while the tab is hidden. The server escapes everything it renders, so the
// new content is the server's markup as a reload would show it.
(function () {
  "use strict";
  var main = document.getElementById("main");
  if (!main || main.getAttribute("data-live") !== "1" || !window.fetch) { return; }
  var etag = null, delay = 2000, timer = null;
  var MIN = 2000, MAX_SAME = 30000, MAX_ERR = 60000;
  function schedule() {
    clearTimeout(timer);
    if (document.hidden) { return; }
    timer = setTimeout(poll, delay);
  }
  function busy() {
    // Never replace content under a user's typing or an open disclosure.
    var a = document.activeElement;
    if (a && main.contains(a) && /^(INPUT|TEXTAREA|SELECT)$/.test(a.tagName)) { return true; }
    return main.querySelector("details[open]") !== null;
  }
  function poll() {
    if (busy()) { schedule(); return; }
    var headers = { "X-Cgx-Live": "1" };
    if (etag) { headers["If-None-Match"] = etag; }
    fetch(window.location.href, { headers: headers, credentials: "same-origin", cache: "no-cache",
                                  redirect: "manual" })
      .then(function (r) {
        // The session ended (a redirect to sign in): reload, so the browser shows where it
        // leads, rather than pouring the sign-in page into this one.
        if (r.type === "opaqueredirect" || r.status === 401) { window.location.reload(); return null; }
        if (r.status === 304) { delay = Math.min(delay * 1.5, MAX_SAME); return null; }
        if (!r.ok) { throw new Error("status " + r.status); }
        etag = r.headers.get("ETag");
        return r.text();
      })
      .then(function (text) {
        if (text === null) { return; }
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("main");
        if (fresh && fresh.innerHTML !== main.innerHTML) {
          main.innerHTML = fresh.innerHTML;
          delay = MIN;
        } else {
          delay = Math.min(delay * 1.5, MAX_SAME);
        }
      })
      .catch(function () { delay = Math.min(Math.max(delay, MIN) * 2, MAX_ERR); })
      .then(schedule);
  }
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) { delay = MIN; schedule(); }
  });
  schedule();
})();
