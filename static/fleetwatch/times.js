/* Times: every <time datetime> the pages write (the when/ago template filters) is shown in
   UTC, as the server renders it, or in the browser's time zone, as the person chooses with
   the footer's switch (kept in localStorage). "full" times show the date and time and how
   long ago; "ago" ones how long ago, the date and time in their tooltip. Live regions
   swapped in by htmx are rewritten too. A static file: the CSP allows no inline script. */
(function () {
  "use strict";
  const KEY = "fleetwatch.tz";
  const pad = (n) => String(n).padStart(2, "0");

  function zone() {
    try { return window.localStorage.getItem(KEY) === "local" ? "local" : "utc"; }
    catch (e) { return "utc"; }
  }

  function absolute(d, local) {
    const y = local ? d.getFullYear() : d.getUTCFullYear();
    const parts = local
      ? [d.getMonth() + 1, d.getDate(), d.getHours(), d.getMinutes(), d.getSeconds()]
      : [d.getUTCMonth() + 1, d.getUTCDate(), d.getUTCHours(), d.getUTCMinutes(), d.getUTCSeconds()];
    const name = local ? (Intl.DateTimeFormat().resolvedOptions().timeZone || "local") : "UTC";
    return `${y}-${pad(parts[0])}-${pad(parts[1])} ${pad(parts[2])}:${pad(parts[3])}:${pad(parts[4])} ${name}`;
  }

  function relative(d) {
    let s = (Date.now() - d.getTime()) / 1000;
    const future = s < 0;
    s = Math.abs(s);
    if (s < 5) return "just now";
    const units = [["d", 86400], ["h", 3600], ["min", 60], ["s", 1]];
    const [name, size] = units.find(([, size]) => s >= size);
    const text = `${Math.floor(s / size)} ${name}`;
    return future ? `in ${text}` : `${text} ago`;
  }

  function rewrite(root) {
    const local = zone() === "local";
    root.querySelectorAll("time[datetime][data-show]").forEach((el) => {
      const d = new Date(el.getAttribute("datetime"));
      if (Number.isNaN(d.getTime())) return;
      const abs = absolute(d, local);
      el.title = abs;
      el.textContent = el.dataset.show === "full" ? `${abs} · ${relative(d)}` : relative(d);
    });
    const button = document.getElementById("tz-toggle");
    if (button) {
      button.textContent = local ? "Show times in UTC" : "Show times in my time zone";
      button.setAttribute("aria-pressed", String(local));
      const label = document.getElementById("tz-label");
      if (label) label.textContent = local ? "Times are in your browser's time zone." : "Times are UTC.";
    }
  }

  function start() {
    const button = document.getElementById("tz-toggle");
    if (button) {
      button.hidden = false;
      button.addEventListener("click", () => {
        try { window.localStorage.setItem(KEY, zone() === "local" ? "utc" : "local"); } catch (e) { /* private mode */ }
        rewrite(document);
      });
    }
    rewrite(document);
    // The relative readings age while the page is open.
    setInterval(() => rewrite(document), 30000);
  }

  document.addEventListener("htmx:afterSwap", (evt) => rewrite(evt.detail.target || document));
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
