/* FleetWatch charts: the dashboard's GPU health grid and the incident's utilisation chart.
   Both read JSON from the page's data-src and redraw in place every few seconds. */
(function () {
  "use strict";
  const config = { displaylogo: false, responsive: true };

  async function load(el) {
    const response = await fetch(el.dataset.src, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(response.status);
    return response.json();
  }

  async function drawGrid(el) {
    const d = await load(el);
    if (!d.z.length) { el.textContent = "No GPU telemetry yet."; return; }
    const trace = {
      type: "heatmap", z: d.z, x: d.x, y: d.y, text: d.text, hoverinfo: "text",
      zmin: 0, zmax: 2, showscale: false, xgap: 2, ygap: 2,
      colorscale: [[0, "#2e9d5b"], [0.5, "#9aa0a6"], [1, "#d93025"]],
    };
    const layout = {
      margin: { l: 130, r: 10, t: 10, b: 30 }, height: Math.max(240, 18 * d.y.length + 50),
      yaxis: { autorange: "reversed", automargin: true }, paper_bgcolor: "rgba(0,0,0,0)",
    };
    window.Plotly.react(el, [trace], layout, config);
  }

  async function drawUtil(el) {
    const d = await load(el);
    const traces = Object.entries(d.series).map(([node, s]) => ({
      type: "scatter", mode: "lines", name: node, x: s.x, y: s.y,
    }));
    if (d.error) {
      // Telemetry (Prometheus) could not be read: say so instead of an empty chart.
      window.Plotly.purge(el);
      el.textContent = d.error;
      return;
    }
    const marks = [{ at: d.fault_at, label: "fault", color: "#d93025" }];
    if (d.resolved_at) marks.push({ at: d.resolved_at, label: "resolved", color: "#2e9d5b" });
    const layout = {
      margin: { l: 50, r: 10, t: 20, b: 40 }, height: 320,
      yaxis: { title: { text: "GPU util %" }, range: [0, 105] },
      xaxis: { type: "date" }, paper_bgcolor: "rgba(0,0,0,0)",
      shapes: marks.map((m) => ({ type: "line", xref: "x", yref: "paper", x0: m.at, x1: m.at,
        y0: 0, y1: 1, line: { color: m.color, dash: "dot" } })),
      annotations: marks.map((m) => ({ x: m.at, y: 1, yref: "paper", text: m.label,
        showarrow: false, font: { color: m.color } })),
    };
    window.Plotly.react(el, traces, layout, config);
  }

  function every(el, draw, ms) {
    const run = () => draw(el).catch((e) => { el.dataset.error = String(e); });
    run();
    setInterval(run, ms);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const grid = document.getElementById("gpu-grid");
    if (grid) every(grid, drawGrid, 5000);
    const util = document.getElementById("util-chart");
    if (util) every(util, drawUtil, 3000);
  });
})();
