// The console's one script (docs/console.md): every element with data-live is refetched every
// data-every milliseconds from its data-live URL (the page's live part, rendered by the
// server) and replaced in place, so a page updates without a reload. Requests go to this origin
// only; a 401 (the session ended) goes to the sign-in page. Nothing else runs here: forms post
// as forms, with the session's CSRF token in a hidden field.
"use strict";

function follow(section) {
  const every = Number(section.dataset.every) || 2000;
  let busy = false;
  async function refresh() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const answer = await fetch(section.dataset.live, {
        credentials: "same-origin",
        headers: { "Accept": "text/html" },
        cache: "no-store",
      });
      if (answer.status === 401) {
        window.location.assign("/console/login");
        return;
      }
      if (answer.ok) {
        section.innerHTML = await answer.text();
        section.classList.remove("stale");
      } else {
        section.classList.add("stale");
      }
    } catch (error) {
      section.classList.add("stale"); // the API is away: the page keeps its last data
    } finally {
      busy = false;
    }
  }
  window.setInterval(refresh, every);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(follow);
});
