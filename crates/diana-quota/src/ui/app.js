// The fleet view's page (crates/diana-quota/src/ui/mod.rs): reads GET /v1/view every
// 2 seconds and draws it. No library, no build step.
//
// Every name and label in the view (identities, paths, rules, breakers, gateways) comes
// from clients or gateways: it reaches the page only through textContent and
// setAttribute (see `el`), never as markup. The token stays in this tab's sessionStorage
// and is sent only as `authorization: Bearer` to this origin's /v1/view.
"use strict";

(() => {
  const VIEW_URL = "/v1/view";
  const TOKEN_KEY = "diana.view.token";
  const REFRESH_MS = 2000;
  const RETRY_MAX_MS = 10000;
  const FETCH_TIMEOUT_MS = 5000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  // The chart's drawing box (scaled to the card's width).
  const CHART_W = 900;
  const CHART_H = 100;

  const byId = (id) => document.getElementById(id);

  // --- the token ------------------------------------------------------------------------
  // Kept in memory, and in sessionStorage so that a reload of the tab keeps it (storage
  // may be unavailable: then memory only).
  let token = readToken();

  function readToken() {
    try {
      return window.sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }

  function keepToken(value) {
    token = value;
    try {
      if (value) {
        window.sessionStorage.setItem(TOKEN_KEY, value);
      } else {
        window.sessionStorage.removeItem(TOKEN_KEY);
      }
    } catch (_) {
      // memory only
    }
  }

  // --- building elements: text only -------------------------------------------------------

  // `el("td", {class: "num"}, "12", child)`: attributes by setAttribute (names are this
  // script's, values may be data: an attribute value is never parsed as markup), children
  // as text nodes or elements.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
  }

  // --- numbers and times --------------------------------------------------------------------

  const num = (value) => (Number.isFinite(value) ? value : 0);
  const clamp = (value, low, high) => Math.min(high, Math.max(low, value));

  function count(value) {
    return Math.round(num(value)).toLocaleString("en-US");
  }

  function rate(perSecond) {
    const value = num(perSecond);
    if (value === 0) return "0";
    if (value < 10) return value.toFixed(1);
    return Math.round(value).toLocaleString("en-US");
  }

  function percent(ppm) {
    return `${(num(ppm) / 10000).toFixed(0)}%`;
  }

  function clock(ms) {
    if (!Number.isFinite(ms)) return "–";
    return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
  }

  // How long before the view's own clock (`now_ms`): the service's clock, not this
  // browser's, so a skewed laptop shows the right ages.
  function ago(ms, now) {
    if (!Number.isFinite(ms)) return "never";
    const seconds = Math.max(0, Math.round((now - ms) / 1000));
    if (seconds < 1) return "just now";
    if (seconds < 120) return `${seconds} s ago`;
    return `${Math.round(seconds / 60)} min ago`;
  }

  function duration(ms) {
    const seconds = Math.max(0, Math.ceil(num(ms) / 1000));
    return seconds < 120 ? `${seconds} s` : `${Math.round(seconds / 60)} min`;
  }

  // --- rates from the series ----------------------------------------------------------------

  // Per bucket: requests per second. The last bucket is still filling: its point is the
  // recent rate (with the bucket before it), so that a bucket a second old, holding one
  // or two ticks' reports, does not spike.
  function bucketRates(series, counts, now) {
    const bucketMs = num(series.bucket_ms) || 10000;
    const n = counts.length;
    return counts.map((c, i) => (i === n - 1 ? recentRate(series, counts, now) : (num(c) * 1000) / bucketMs));
  }

  // Requests per second over the current bucket and the one before it (10 to 20 s).
  function recentRate(series, counts, now) {
    const bucketMs = num(series.bucket_ms) || 10000;
    const n = counts.length;
    if (n === 0) return 0;
    const currentStart = num(series.start_ms) + (n - 1) * bucketMs;
    const covered = clamp(now - currentStart, 0, bucketMs) + (n > 1 ? bucketMs : 0);
    const requests = num(counts[n - 1]) + (n > 1 ? num(counts[n - 2]) : 0);
    return covered > 0 ? (requests * 1000) / covered : 0;
  }

  // Requests in the last minute's buckets (the current one and the five before it).
  function lastMinute(counts) {
    return counts.slice(-6).reduce((sum, c) => sum + num(c), 0);
  }

  // --- the chart ------------------------------------------------------------------------------

  const SERIES = [
    ["admitted", "admitted"],
    ["limited", "limited"],
    ["dry_run_limited", "dry run"],
  ];

  function chart(series, rule, now) {
    const lines = SERIES.map(([field]) => {
      const counts = Array.isArray(rule[field]) ? rule[field] : [];
      return [field, bucketRates(series, counts, now)];
    }).filter(([field, rates]) => field !== "dry_run_limited" || rates.some((r) => r > 0));
    const highest = Math.max(1, ...lines.flatMap(([, rates]) => rates));
    const svg = svgEl("svg", {
      class: "chart",
      viewBox: `0 0 ${CHART_W} ${CHART_H}`,
      preserveAspectRatio: "none",
      role: "img",
      "aria-label": "admitted and limited per second, last 15 minutes",
    });
    for (const fraction of [0.25, 0.5, 0.75]) {
      const y = (CHART_H * fraction).toFixed(1);
      svg.append(svgEl("line", { class: "grid", x1: 0, x2: CHART_W, y1: y, y2: y, "vector-effect": "non-scaling-stroke" }));
    }
    for (const [field, rates] of lines) {
      const n = rates.length;
      if (n === 0) continue;
      const step = n > 1 ? CHART_W / (n - 1) : CHART_W;
      const points = rates.map((r, i) => {
        const x = (i * step).toFixed(1);
        const y = (CHART_H - (r / highest) * CHART_H * 0.95).toFixed(1);
        return `${x},${y}`;
      });
      const d = field === "dry_run_limited"
        ? `M${points.join(" L")}`
        : `M0,${CHART_H} L${points.join(" L")} L${((n - 1) * step).toFixed(1)},${CHART_H} Z`;
      svg.append(svgEl("path", { class: field, d, "vector-effect": "non-scaling-stroke" }));
    }
    const note = el("div", { class: "axis-note" },
      el("span", null, "15 min ago"),
      el("span", null, `top of the chart: ${rate(highest)}/s`),
      el("span", null, "now"));
    return [svg, note];
  }

  // --- hot lists ------------------------------------------------------------------------------

  // A merged Space-Saving list: largest first, as the view sorts it.
  function hotTable(list, kind, what) {
    const box = el("div", { class: `hot-list hot-${kind}` });
    if (!list || !Array.isArray(list.items) || list.items.length === 0) {
      box.append(el("p", { class: "empty" }, `no ${what} reported in the last minute`));
      return box;
    }
    const top = Math.max(1, num(list.items[0].count));
    const body = el("tbody");
    list.items.slice(0, 10).forEach((item, i) => {
      const bar = el("div", { class: "bar" });
      bar.style.width = `${clamp((num(item.count) / top) * 100, 1, 100)}%`;
      const label = String(item.label);
      body.append(el("tr", { class: "hot-item" },
        el("td", { class: "num" }, String(i + 1)),
        el("td", null, el("span", { class: "label", title: label }, label), bar),
        el("td", { class: "num count" }, count(item.count)),
        el("td", { class: "num" }, num(item.error) > 0 ? `±${count(item.error)}` : "")));
    });
    box.append(el("table", null,
      el("thead", null, el("tr", null,
        el("th", { class: "num" }, "#"), el("th", null, what), el("th", { class: "num" }, "requests"), el("th", { class: "num" }, "error"))),
      body));
    const notes = [`${count(list.total)} requests counted`];
    if (num(list.floor) > 0) notes.push(`any not listed ≤ ${count(list.floor)}`);
    box.append(el("p", { class: "muted" }, notes.join(" · ")));
    return box;
  }

  // --- sections -------------------------------------------------------------------------------

  function tile(name, value, alert) {
    return el("div", { class: alert ? "tile alert" : "tile" },
      el("div", { class: "value" }, value), el("div", { class: "name" }, name));
  }

  function renderSummary(view, now) {
    const gateways = view.gateways || [];
    const rules = view.rules || [];
    const breakers = view.breakers || [];
    const degraded = gateways.filter((g) => g.degraded).length;
    const limited = rules.reduce((sum, r) => sum + recentRate(view.series, r.limited || [], now), 0);
    const admitted = rules.reduce((sum, r) => sum + recentRate(view.series, r.admitted || [], now), 0);
    const open = breakers.filter((b) => breakerStatus(b) !== "closed").length;
    const dropped = view.dropped || {};
    const droppedTotal = num(dropped.gateways) + num(dropped.rules) + num(dropped.breakers);
    const tiles = [
      tile("gateways reporting", count(gateways.length)),
      tile("running degraded", count(degraded), degraded > 0),
      tile("admitted / s", rate(admitted)),
      tile("limited / s", rate(limited), limited > 0),
      tile("breakers not closed", count(open), open > 0),
      tile("reports received", count(view.reports)),
    ];
    if (droppedTotal > 0) {
      tiles.push(tile(`not tracked (tables full): ${count(dropped.gateways)} gateways, ${count(dropped.rules)} rules, ${count(dropped.breakers)} breakers`, count(droppedTotal), true));
    }
    byId("summary").replaceChildren(...tiles);
  }

  function renderRules(view, now) {
    const rules = (view.rules || []).slice();
    // The rules limiting most in the last minute first: where the flood is.
    rules.sort((a, b) => lastMinute(b.limited || []) - lastMinute(a.limited || [])
      || String(a.name).localeCompare(String(b.name)));
    const cards = rules.map((rule) => {
      const totals = rule.totals || {};
      const rates = el("div", { class: "rates" },
        ...SERIES.filter(([field]) => field !== "dry_run_limited" || num(totals.dry_run_limited) > 0)
          .map(([field, name]) => el("span", { class: `rate ${field}` },
            el("b", null, rate(recentRate(view.series, rule[field] || [], now))), ` ${name}/s`)),
        el("span", { class: "muted" },
          `since tracked: ${count(totals.admitted)} admitted, ${count(totals.limited)} limited · last report ${ago(rule.last_report_ms, now)}`));
      return el("section", { class: "card rule" },
        el("h3", { class: "name" }, String(rule.name)),
        rates,
        ...chart(view.series || {}, rule, now),
        el("div", { class: "hot" },
          el("div", null, el("h4", null, "Hottest limited identities"), hotTable(rule.hot_limited, "limited", "identity")),
          el("div", null, el("h4", null, "Hottest admitted identities"), hotTable(rule.hot_admitted, "admitted", "identity"))));
    });
    byId("rules").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty" }, "no rule reported yet")]));
  }

  function renderPaths(view) {
    byId("paths").replaceChildren(el("div", { class: "card" }, hotTable(view.paths, "paths", "path")));
  }

  const SEVERITY = { closed: 0, half_open: 1, open: 2 };

  // The fleet's state; for a local breaker, the worst of its gateways' statuses.
  function breakerStatus(breaker) {
    if (breaker.state && breaker.state.status) return breaker.state.status;
    let worst = "closed";
    for (const g of breaker.gateways || []) {
      if ((SEVERITY[g.status] || 0) > (SEVERITY[worst] || 0)) worst = g.status;
    }
    return worst;
  }

  function statusText(status) {
    return status === "half_open" ? "half-open" : String(status);
  }

  function badge(status) {
    return el("span", { class: `badge ${SEVERITY[status] === undefined ? "" : status}` }, statusText(status));
  }

  function figures(f) {
    if (!f) return "";
    return `${count(f.calls)} calls, ${count(f.slow)} slow, ${count(f.failed)} failed`;
  }

  function renderBreakers(view, now) {
    const cards = (view.breakers || []).map((breaker) => {
      const status = breakerStatus(breaker);
      const state = breaker.state;
      const head = el("div", { class: "breaker-head" },
        el("h3", { class: "name" }, String(breaker.name)),
        badge(status),
        el("span", { class: "muted" }, breaker.fleet ? "fleet (scope: global)" : "local: each gateway's own"));
      const lines = [];
      if (state) {
        lines.push(el("p", { class: "figures" }, `fleet window: ${figures(state.window)}`));
        if (state.status === "open" && Number.isFinite(state.half_open_at_ms)) {
          lines.push(el("p", { class: "figures" }, `half-open in ${duration(state.half_open_at_ms - now)}`));
        }
        const p = state.params || {};
        const thresholds = [];
        if (num(p.slow_ratio_ppm) > 0) thresholds.push(`${percent(p.slow_ratio_ppm)} slow`);
        if (num(p.failure_ratio_ppm) > 0) thresholds.push(`${percent(p.failure_ratio_ppm)} failed`);
        lines.push(el("p", { class: "muted" },
          `opens at ${thresholds.join(" or ") || "–"} of ≥ ${count(p.min_calls)} calls in ${count(p.window_seconds)} s; open ${duration(p.open_ms)}, then ${count(p.half_open_calls)} probes`));
      }
      const totals = breaker.transitions_total || {};
      lines.push(el("p", { class: "muted" },
        `transitions here: opened ${count(totals.open)}, half-open ${count(totals.half_open)}, closed ${count(totals.closed)}`));
      const transitions = (breaker.transitions || []).slice().reverse();
      if (transitions.length) {
        lines.push(el("ol", { class: "transitions", reversed: "" }, ...transitions.map((t) => el("li", null,
          `${clock(t.at_ms)} `, badge(t.from), " → ", badge(t.to), ` ${String(t.cause)}`,
          (t.calls !== undefined && t.calls !== null) ? ` · ${figures(t)}` : ""))));
      }
      const gateways = breaker.gateways || [];
      if (gateways.length) {
        lines.push(el("p", { class: "figures" }, "gateways: ", ...gateways.map((g) => el("span", { class: "gateway-status" },
          el("code", null, String(g.gateway)), " ", badge(g.status), ` ${ago(g.at_ms, now)}`))));
      }
      return el("section", { class: `card breaker ${status}` }, head, ...lines);
    });
    byId("breakers").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty" }, "no breaker reported")]));
  }

  function renderGateways(view, now) {
    const gateways = view.gateways || [];
    if (gateways.length === 0) {
      byId("gateways").replaceChildren(el("p", { class: "empty" }, "no gateway has reported in the last 15 minutes"));
      return;
    }
    const rows = gateways.map((g) => el("tr", { class: "gateway" },
      el("td", null, el("code", { class: "name" }, String(g.id))),
      el("td", null, g.degraded ? el("span", { class: "badge degraded" }, "degraded") : el("span", { class: "badge ok" }, "ok")),
      el("td", { class: "num" }, ago(g.last_report_ms, now)),
      el("td", { class: "num" }, count(g.reports)),
      el("td", null, ...(g.breakers || []).flatMap((b) => [String(b.name), " ", badge(b.status), " "]))));
    byId("gateways").replaceChildren(el("div", { class: "card" }, el("table", null,
      el("thead", null, el("tr", null,
        el("th", null, "gateway"), el("th", null, "global rules"), el("th", { class: "num" }, "last report"),
        el("th", { class: "num" }, "reports"), el("th", null, "breakers"))),
      el("tbody", null, ...rows))));
  }

  let renders = 0;

  function render(view) {
    view.series = view.series || {};
    const now = num(view.now_ms) || Date.now();
    renderSummary(view, now);
    renderRules(view, now);
    renderBreakers(view, now);
    renderPaths(view);
    renderGateways(view, now);
    renders += 1;
    document.documentElement.dataset.renders = String(renders);
  }

  // --- the loop -------------------------------------------------------------------------------

  function setStatus(text, stale) {
    const status = byId("status");
    status.textContent = text;
    status.classList.toggle("stale", Boolean(stale));
  }

  function show(which) {
    byId("signin").hidden = which !== "signin";
    byId("view").hidden = which !== "view";
    byId("forget").hidden = !token;
    document.documentElement.dataset.showing = which;
  }

  function signIn(message) {
    byId("view").hidden = true;
    // Nothing of the last view stays in the page.
    for (const id of ["summary", "rules", "breakers", "paths", "gateways"]) byId(id).replaceChildren();
    const error = byId("signin-error");
    error.textContent = message || "";
    error.hidden = !message;
    setStatus("sign in to see the fleet");
    show("signin");
    byId("token").focus();
  }

  let timer = null;
  let failures = 0;
  let generation = 0;

  function schedule(delay) {
    window.clearTimeout(timer);
    timer = window.setTimeout(refresh, delay);
  }

  async function refresh() {
    window.clearTimeout(timer);
    const mine = ++generation;
    const sent = token;
    const headers = { accept: "application/json" };
    if (sent) headers.authorization = `Bearer ${sent}`;
    const abort = new AbortController();
    const timeout = window.setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
    let answer = null;
    let problem = "";
    try {
      const response = await fetch(VIEW_URL, {
        headers,
        cache: "no-store",
        credentials: "omit",
        redirect: "error",
        referrerPolicy: "no-referrer",
        signal: abort.signal,
      });
      if (response.status === 401) {
        answer = { refused: true };
      } else if (!response.ok) {
        problem = `diana-quota answered ${response.status}`;
      } else {
        answer = { view: await response.json() };
      }
    } catch (error) {
      problem = error && error.name === "AbortError"
        ? `no answer within ${FETCH_TIMEOUT_MS / 1000} s`
        : "diana-quota cannot be reached";
    } finally {
      window.clearTimeout(timeout);
    }
    // A newer refresh (a sign-in meanwhile) decides.
    if (mine !== generation) return;
    if (answer && answer.refused) {
      if (sent) keepToken("");
      signIn(sent ? "That token was refused (401). Check it, or diana-quota's --view-token-file." : "");
      return;
    }
    if (answer && answer.view) {
      failures = 0;
      try {
        render(answer.view);
      } catch (error) {
        setStatus(`the view could not be drawn: ${error && error.message}`, true);
        schedule(REFRESH_MS);
        return;
      }
      show("view");
      setStatus(`live · updated ${clock(answer.view.now_ms)} · every ${REFRESH_MS / 1000} s${sent ? "" : " · the view is open to anyone (--insecure-open-view)"}`);
      schedule(REFRESH_MS);
      return;
    }
    failures += 1;
    const delay = Math.min(RETRY_MAX_MS, REFRESH_MS * 2 ** Math.min(failures - 1, 3));
    setStatus(`stale: ${problem}; trying again in ${Math.round(delay / 1000)} s`, true);
    schedule(delay);
  }

  function start() {
    byId("signin-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = byId("token");
      const value = input.value.trim();
      // The field never keeps the secret once it is taken.
      input.value = "";
      if (!value) return;
      // The service's secrets are printable ASCII; anything else could not even be sent
      // as a header.
      if (!/^[\x21-\x7e]+$/.test(value)) {
        signIn("A token is printable ASCII without spaces: check what was pasted.");
        return;
      }
      keepToken(value);
      byId("signin-error").hidden = true;
      setStatus("signing in…");
      refresh();
    });
    byId("forget").addEventListener("click", () => {
      keepToken("");
      window.clearTimeout(timer);
      generation += 1;
      signIn("");
    });
    refresh();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
