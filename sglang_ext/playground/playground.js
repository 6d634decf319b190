// The sglang-ext playground: streams /v1/chat/completions from the server that served this page and
// colours each token by its SingProbe score (`token_probe_probs`: one {label: probability} per token).
// Plain browser JavaScript, no build step, nothing loaded from elsewhere.
"use strict";

(function () {
  const SCORES = "token_probe_probs";
  const GUARD_FINISH = "content_filter";
  const PREFERRED_LABEL_INDEX = 8;  // SingProbe's response-unsafe label
  const SAMPLE_TOOL = {
    type: "function",
    function: {
      name: "get_weather",
      description: "Current weather for a city",
      parameters: {type: "object", properties: {city: {type: "string"}}, required: ["city"]},
    },
  };

  const $ = (id) => document.getElementById(id);
  const ui = {
    form: $("ask"), prompt: $("prompt"), colourLabel: $("colour-label"), stopLabel: $("stop-label"),
    threshold: $("threshold"), thresholdValue: $("threshold-value"), maxTokens: $("max-tokens"),
    offerTool: $("offer-tool"), apiKey: $("api-key"), send: $("send"), cancel: $("cancel"),
    status: $("status"), message: $("message"), guardStop: $("guard-stop"), probeNote: $("probe-note"),
    reasoning: $("reasoning"), answer: $("answer"), toolsPane: $("tools-pane"), tools: $("tools"),
    detail: $("detail-body"),
  };

  // What the server told us (GET /playground/info); null until it answered.
  let info = null;
  let running = null;  // the AbortController of the request in flight

  // -- messages -----------------------------------------------------------------------------------

  function setStatus(state, text) {
    ui.status.dataset.state = state;
    ui.status.textContent = text;
  }

  function showError(text) {
    ui.message.textContent = text;
    ui.message.hidden = false;
    setStatus("error", "error");
  }

  function clearError() {
    ui.message.hidden = true;
    ui.message.textContent = "";
  }

  // A failure anywhere in this script shows a message instead of leaving the page half drawn.
  window.addEventListener("error", (e) => showError("The page hit an error: " + (e.message || e)));
  window.addEventListener("unhandledrejection", (e) => showError("The page hit an error: " + (e.reason && e.reason.message || e.reason)));

  function authHeaders() {
    const key = ui.apiKey.value.trim();
    return key ? {"Authorization": "Bearer " + key} : {};
  }

  async function errorText(response) {
    const body = await response.text().catch(() => "");
    try {
      const j = JSON.parse(body);
      const e = j.error !== undefined ? j.error : j;
      const text = typeof e === "string" ? e : (e.message || e.detail || j.detail || JSON.stringify(e));
      return typeof text === "string" ? text : JSON.stringify(text);
    } catch (_) {
      return body.trim() || response.statusText || "no details";
    }
  }

  // -- colours ------------------------------------------------------------------------------------

  function colourOf(p) {
    if (typeof p !== "number" || !isFinite(p)) return "transparent";
    const q = Math.min(1, Math.max(0, p));
    return `hsla(${Math.round((1 - q) * 120)}, 85%, 45%, 0.55)`;
  }

  function colourLabel() {
    return ui.colourLabel.value;
  }

  function paint(span) {
    const scores = span.dataset.scores ? JSON.parse(span.dataset.scores) : null;
    span.style.background = scores ? colourOf(scores[colourLabel()]) : "transparent";
  }

  function repaintAll() {
    document.querySelectorAll("span.tok").forEach(paint);
  }

  // -- labels and the guard -----------------------------------------------------------------------

  function fillLabels(labels) {
    for (const select of [ui.colourLabel, ui.stopLabel]) {
      const keep = select.value;
      select.textContent = "";
      for (const name of labels) {
        const option = document.createElement("option");
        option.value = option.textContent = name;
        select.appendChild(option);
      }
      if (labels.includes(keep)) select.value = keep;
      else if (labels.length > PREFERRED_LABEL_INDEX) select.value = labels[PREFERRED_LABEL_INDEX];
    }
  }

  function probeOff(text) {
    ui.probeNote.textContent = text;
    ui.probeNote.hidden = false;
    for (const el of [ui.colourLabel, ui.stopLabel, ui.threshold]) el.disabled = true;
    ui.thresholdValue.textContent = "off";
  }

  function applyInfo(data) {
    info = data;
    if (!data.probe) {
      probeOff("This server runs without a SingProbe (no --probe-ckpt): tokens are shown without colours and " +
               "the guard is not available.");
      return;
    }
    ui.probeNote.hidden = true;
    for (const el of [ui.colourLabel, ui.stopLabel, ui.threshold]) el.disabled = false;
    fillLabels(data.labels);
    const guard = data.operator_probe_stop || {};
    if (Object.keys(guard).length) {
      ui.probeNote.textContent = "The operator's guard is on for every request: " +
        Object.entries(guard).map(([k, v]) => `${k} > ${v}`).join(", ") +
        ". The slider can only make it stricter.";
      ui.probeNote.hidden = false;
    }
    showThreshold();
  }

  async function loadInfo() {
    let response;
    try {
      response = await fetch("/playground/info", {headers: authHeaders()});
    } catch (e) {
      showError("Cannot reach the server: " + e.message);
      return false;
    }
    if (response.status === 401 || response.status === 403) {
      showError("This server needs an API key: enter it above, then press Send.");
      return false;
    }
    if (!response.ok) {
      showError(`The server answered ${response.status} to /playground/info: ${await errorText(response)}`);
      return false;
    }
    applyInfo(await response.json());
    return true;
  }

  function requestThreshold() {
    const t = Number(ui.threshold.value);
    return t >= 1 ? null : t;  // 1 is "off": a sigmoid never exceeds it
  }

  function showThreshold() {
    const t = requestThreshold();
    ui.thresholdValue.textContent = t === null ? "off" : t.toFixed(2);
  }

  // The thresholds that applied to this request: the lower of the operator's and ours, per label.
  function effectiveThresholds(requested) {
    const merged = Object.assign({}, (info && info.operator_probe_stop) || {});
    for (const [label, t] of Object.entries(requested)) {
      merged[label] = label in merged ? Math.min(merged[label], t) : t;
    }
    return merged;
  }

  // -- the token detail panel ---------------------------------------------------------------------

  function showDetail(span) {
    document.querySelectorAll("span.tok.selected").forEach((s) => s.classList.remove("selected"));
    span.classList.add("selected");
    ui.detail.textContent = "";
    const head = document.createElement("div");
    const text = span.dataset.text || "";
    head.textContent = `token ${Number(span.dataset.index) + 1}: ` +
      (text ? JSON.stringify(text) : "(no visible text: held back by the parser, or a special token)");
    ui.detail.appendChild(head);
    if (!span.dataset.scores) {
      const none = document.createElement("div");
      none.textContent = "no scores (the server has no probe)";
      ui.detail.appendChild(none);
      return;
    }
    const scores = JSON.parse(span.dataset.scores);
    const grid = document.createElement("div");
    grid.className = "scores";
    for (const [name, p] of Object.entries(scores)) {
      const row = document.createElement("div");
      row.className = "score-row" + (name === colourLabel() ? " chosen" : "");
      const label = document.createElement("span");
      label.className = "name";
      label.textContent = name;
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.style.width = `${Math.round(Math.min(1, Math.max(0, p)) * 100)}%`;
      fill.style.background = colourOf(p);
      bar.appendChild(fill);
      const value = document.createElement("span");
      value.textContent = typeof p === "number" ? p.toFixed(4) : String(p);
      row.append(label, bar, value);
      grid.appendChild(row);
    }
    ui.detail.appendChild(grid);
  }

  for (const pane of [ui.reasoning, ui.answer, ui.tools]) {
    pane.addEventListener("mouseover", (e) => { if (e.target.classList.contains("tok")) showDetail(e.target); });
    pane.addEventListener("click", (e) => { if (e.target.classList.contains("tok")) showDetail(e.target); });
  }

  // -- one streamed answer ------------------------------------------------------------------------

  class StreamCut extends Error {}

  // The JSON payload of each `data:` line, until [DONE]; a body that ends before [DONE] was cut.
  async function* sseEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let newline;
      // split on \n only: a JSON string may hold U+2028, which other line rules would split on
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, "");
        buffer = buffer.slice(newline + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        let event;
        try {
          event = JSON.parse(data);
        } catch (_) {
          throw new Error("the server sent a line that is not JSON: " + data.slice(0, 200));
        }
        yield event;
      }
    }
    throw new StreamCut("the stream ended before the server said it was done");
  }

  // One streamed answer. Each chunk brings the scores of the tokens decoded since the previous chunk
  // (`token_probe_probs`), the text of those tokens (`logprobs.content[].token`, requested for that) and
  // text by channel (`delta`). A parser (reasoning, tool calls) may hold text back and release it with a
  // later token, so the three are joined by token index: a token is created when its score or its text
  // arrives, and placed in the pane (reasoning, answer, tool call) of the next channel text that arrives.
  class Answer {
    constructor() {
      this.tokens = [];  // spans, in token order
      this.scoreCount = 0;
      this.textCount = 0;
      this.unplaced = [];
      this.pane = ui.answer;  // the pane of the latest channel text
      this.sawTokenText = false;
      this.channelText = new Map();  // pane -> its text, shown as is where no token text came
      this.toolBlocks = new Map();
      this.finishReason = null;
      this.usage = null;
    }

    get lastSpan() {
      return this.tokens.length ? this.tokens[this.tokens.length - 1] : null;
    }

    token(index) {
      while (this.tokens.length <= index) {
        const span = document.createElement("span");
        span.className = "tok empty";
        span.dataset.index = String(this.tokens.length);
        span.dataset.text = "";
        this.tokens.push(span);
        this.unplaced.push(span);
      }
      return this.tokens[index];
    }

    setScores(scores) {
      const span = this.token(this.scoreCount++);
      span.dataset.scores = JSON.stringify(scores);
      paint(span);
    }

    setText(text) {
      const span = this.token(this.textCount++);
      span.dataset.text = text;
      span.textContent = text;
      span.classList.toggle("empty", !text);
      if (/^<\|[a-z_]+\|>$/.test(text)) span.classList.add("special");
      this.sawTokenText = true;
    }

    place(pane) {
      for (const span of this.unplaced) pane.appendChild(span);
      this.unplaced = [];
    }

    toolArgs(call) {
      const index = call.index || 0;
      if (!this.toolBlocks.has(index)) {
        const block = document.createElement("div");
        block.className = "tool";
        const name = document.createElement("div");
        name.className = "name";
        const tokens = document.createElement("div");
        tokens.className = "tokens";
        const args = document.createElement("div");
        args.className = "args";
        block.append(name, tokens, args);
        ui.tools.appendChild(block);
        ui.toolsPane.hidden = false;
        this.toolBlocks.set(index, {name, tokens, args});
      }
      const block = this.toolBlocks.get(index);
      const fn = call.function || {};
      if (fn.name) block.name.textContent = "call " + fn.name;
      if (fn.arguments) block.args.textContent += fn.arguments;
      return block.tokens;
    }

    choice(choice) {
      const scores = Array.isArray(choice[SCORES]) ? choice[SCORES] : [];
      scores.forEach((s) => this.setScores(s));
      const logprobs = choice.logprobs && Array.isArray(choice.logprobs.content) ? choice.logprobs.content : [];
      logprobs.forEach((entry) => this.setText(typeof entry.token === "string" ? entry.token : ""));
      const delta = choice.delta || {};
      const channels = [];
      if (delta.reasoning_content) channels.push([ui.reasoning, delta.reasoning_content]);
      if (delta.content) channels.push([ui.answer, delta.content]);
      for (const call of delta.tool_calls || []) channels.push([this.toolArgs(call), ""]);
      for (const [pane, text] of channels) {
        this.place(pane);
        this.pane = pane;
        this.channelText.set(pane, (this.channelText.get(pane) || "") + text);
      }
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }

    end() {
      this.place(this.pane);
      if (this.sawTokenText) return;
      // a server that sent no token texts: the channel text as it came, after that pane's tokens
      for (const [pane, text] of this.channelText) {
        const plain = document.createElement("span");
        plain.className = "plain";
        plain.textContent = text;
        pane.appendChild(plain);
      }
    }

    guardStop(requested) {
      const span = this.lastSpan;
      if (!span) {
        ui.guardStop.textContent = "The guard stopped the request before any token (finish_reason: content_filter).";
        ui.guardStop.hidden = false;
        return;
      }
      span.classList.add("stopped");
      const mark = document.createElement("span");
      mark.className = "stop-mark";
      mark.title = "the guard stopped the answer here";
      mark.textContent = "\u25a0 stop";
      span.after(mark);
      const scores = JSON.parse(span.dataset.scores || "{}");
      let crossing = null;
      for (const [label, t] of Object.entries(effectiveThresholds(requested))) {
        const p = scores[label];
        if (typeof p === "number" && p > t && (!crossing || p - t > crossing.p - crossing.t)) crossing = {label, p, t};
      }
      const where = `at token ${Number(span.dataset.index) + 1} (${JSON.stringify(span.dataset.text)})`;
      ui.guardStop.textContent = crossing
        ? `Stopped by the guard ${where}: ${crossing.label} = ${crossing.p.toFixed(4)} > threshold ` +
          `${crossing.t} (finish_reason: content_filter).`
        : `Stopped by the server's guard ${where} (finish_reason: content_filter).`;
      ui.guardStop.dataset.label = crossing ? crossing.label : "";
      ui.guardStop.dataset.token = span.dataset.index;
      ui.guardStop.hidden = false;
      showDetail(span);
    }
  }

  function resetOutput() {
    for (const pane of [ui.reasoning, ui.answer, ui.tools]) pane.textContent = "";
    ui.toolsPane.hidden = true;
    ui.guardStop.hidden = true;
    ui.guardStop.textContent = "";
    ui.detail.textContent = "Hover over or tap a token to see all its labels.";
    clearError();
  }

  function buildRequest(prompt, requested) {
    const maxTokens = Math.floor(Number(ui.maxTokens.value));
    const body = {
      model: "default",
      messages: [{role: "user", content: prompt}],
      stream: true,
      stream_options: {include_usage: true},
      max_tokens: maxTokens,
      temperature: 0,
      logprobs: true,  // for each token's own text: a parser may hold the channel text back
    };
    if (ui.offerTool.checked) body.tools = [SAMPLE_TOOL];
    if (Object.keys(requested).length) body.custom_params = {probe_stop: requested};
    return body;
  }

  async function send(event) {
    event.preventDefault();
    if (running) return;
    resetOutput();
    const prompt = ui.prompt.value;
    if (!prompt.trim()) {
      showError("The prompt is empty: type a question first.");
      ui.prompt.focus();
      return;
    }
    const maxTokens = Number(ui.maxTokens.value);
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      showError("Max tokens must be a whole number of at least 1.");
      return;
    }
    if (info === null && !(await loadInfo())) return;
    const requested = {};
    const t = requestThreshold();
    if (info.probe && t !== null) requested[ui.stopLabel.value] = t;

    running = new AbortController();
    ui.send.disabled = true;
    ui.cancel.disabled = false;
    setStatus("streaming", "streaming...");
    const answer = new Answer();
    try {
      let response;
      try {
        response = await fetch("/v1/chat/completions", {
          method: "POST",
          headers: Object.assign({"Content-Type": "application/json"}, authHeaders()),
          body: JSON.stringify(buildRequest(prompt, requested)),
          signal: running.signal,
        });
      } catch (e) {
        if (e.name === "AbortError") throw e;
        throw new Error("cannot reach the server: " + e.message);
      }
      if (!response.ok) {
        throw new Error(`the server refused the request (HTTP ${response.status}): ${await errorText(response)}`);
      }
      for await (const chunk of sseEvents(response)) {
        if (chunk.error !== undefined) {
          const e = chunk.error;
          throw new Error("the server ended the stream with an error: " + (e.message || JSON.stringify(e)));
        }
        if (chunk.usage) answer.usage = chunk.usage;
        for (const choice of chunk.choices || []) if ((choice.index || 0) === 0) answer.choice(choice);
      }
      answer.end();
      if (answer.finishReason === GUARD_FINISH) answer.guardStop(requested);
      if (info.probe && answer.scoreCount === 0 && answer.tokens.length > 0) {
        probeOff("The stream carried no scores although the server reported a probe: colours are off for this answer.");
      }
      const n = answer.usage ? answer.usage.completion_tokens : answer.tokens.length;
      setStatus("done", `done: ${n} tokens, finish_reason ${answer.finishReason || "none"}`);
    } catch (e) {
      if (e.name === "AbortError") {
        setStatus("done", "stopped by you");
      } else if (e instanceof StreamCut) {
        answer.end();
        showError(`The server cut the stream after ${answer.tokens.length} tokens: ${e.message}.`);
      } else {
        showError("Request failed: " + e.message);
      }
    } finally {
      running = null;
      ui.send.disabled = false;
      ui.cancel.disabled = true;
    }
  }

  ui.form.addEventListener("submit", (e) => { send(e).catch((err) => showError("Request failed: " + err.message)); });
  ui.cancel.addEventListener("click", () => { if (running) running.abort(); });
  ui.threshold.addEventListener("input", showThreshold);
  ui.colourLabel.addEventListener("change", repaintAll);
  ui.apiKey.addEventListener("change", () => { info = null; loadInfo(); });

  loadInfo().then((ok) => { if (ok) setStatus("idle", "ready"); });
})();
