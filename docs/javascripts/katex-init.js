// Typeset the formulas that pymdownx.arithmatex (generic mode) leaves in the page:
// <span class="arithmatex">\(...\)</span> inline and <div class="arithmatex">\[...\]</div> display.
// Uses the KaTeX shipped under javascripts/katex/ (no network).
(function () {
  "use strict";

  function typeset(root) {
    if (typeof katex === "undefined") return;
    root.querySelectorAll(".arithmatex").forEach(function (el) {
      if (el.dataset.typeset) return;
      var tex = el.textContent.trim();
      var display = el.tagName === "DIV";
      if (tex.startsWith("\\(") || tex.startsWith("\\[")) tex = tex.slice(2, -2);
      try {
        katex.render(tex, el, { displayMode: display, throwOnError: false });
        el.dataset.typeset = "1";
      } catch (err) {
        console.error("KaTeX:", err, tex);
      }
    });
  }

  // Material's instant navigation re-renders the content: typeset on every new document.
  if (typeof document$ !== "undefined") {
    document$.subscribe(function () { typeset(document.body); });
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { typeset(document.body); });
  } else {
    typeset(document.body);
  }
})();
