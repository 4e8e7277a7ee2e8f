// The /realtime page: a WS /v1/realtime/video client playing fMP4 chunks through Media Source Extensions.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  // Observable state (the browser test reads it; handy in the console too).
  const state = window.fvRealtime = {
    chunks: 0, previews: 0, bytes: 0, queued: [], applied: [], errors: [], done: null, requestId: null, mime: null,
  };
  let ws = null, mediaSource = null, sourceBuffer = null, pendingMeta = null;
  const appendQueue = [];

  function log(text, cls) {
    const line = document.createElement("div");
    if (cls) line.className = cls;
    line.textContent = `${new Date().toISOString().slice(11, 23)} ${text}`;
    $("log").prepend(line);
  }

  function pump() {
    if (!sourceBuffer || sourceBuffer.updating) return;
    if (appendQueue.length > 0) {
      sourceBuffer.appendBuffer(appendQueue.shift());
    } else if (state.done && mediaSource.readyState === "open") {
      mediaSource.endOfStream();  // everything appended: the video plays to its end and stops
    }
  }

  function openMedia(mime) {
    if (!window.MediaSource || !MediaSource.isTypeSupported(mime)) {
      log(`this browser cannot play ${mime}`, "error");
      return;
    }
    mediaSource = new MediaSource();
    mediaSource.addEventListener("sourceopen", () => {
      sourceBuffer = mediaSource.addSourceBuffer(mime);
      sourceBuffer.addEventListener("updateend", pump);
      pump();
    }, { once: true });
    $("video").src = URL.createObjectURL(mediaSource);
  }

  function number(id) {
    const value = $(id).value.trim();
    return value === "" ? undefined : Number(value);
  }

  function onText(message) {
    switch (message.type) {
      case "video.start":
        state.requestId = message.request_id;
        $("status").textContent = `streaming ${message.config.width}x${message.config.height} @ ${message.config.fps} fps`;
        log(`video.start ${JSON.stringify(message.config)}`);
        break;
      case "video.chunk_metadata":
        pendingMeta = message;
        break;
      case "video.preview":  // fv: the next chunk's early look, shown until the chunk itself arrives
        state.previews += 1;
        if (message.image) $("preview").src = `data:${message.mime};base64,${message.image}`;
        $("preview-caption").textContent = `preview of chunk ${message.generation_chunk_index}`;
        $("preview-box").style.display = "block";
        break;
      case "video.status":
        $("status").textContent = `${message.chunks} chunks, ${message.frames} frames, `
          + `generating at ${message.generation_fps ?? "?"} fps, sent ${message.send_delay_s}s after decode`;
        break;
      case "session.interaction.queued":
        state.queued.push(message.event_id);
        log(`prompt update ${message.event_id} queued (version ${message.version})`);
        break;
      case "session.prompt_applied":
        state.applied.push(message.event_id);
        log(`prompt update ${message.event_id ?? ""} applied from chunk ${message.chunk_index}`);
        break;
      case "session.pong":
        break;
      case "session.done":
        state.done = message;
        log(`session.done: ${message.chunks} chunks (${message.reason})`);
        pump();
        setRunning(false);
        break;
      case "error":
        state.errors.push(message.error);
        log(`error ${message.error.type ?? ""}: ${message.error.message}`, "error");
        break;
      default:
        log(`${message.type}`);
    }
  }

  function onBinary(data) {
    const meta = pendingMeta;
    pendingMeta = null;
    if (!meta) { log("binary frame without chunk metadata", "error"); return; }
    state.chunks += 1;
    state.bytes += data.byteLength;
    if (!mediaSource) { state.mime = meta.mime; openMedia(meta.mime); }
    appendQueue.push(data);
    pump();
  }

  function setRunning(running) {
    $("start").disabled = running;
    $("stop").disabled = !running;
    $("send-update").disabled = !running;
  }

  $("start-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${scheme}//${location.host}/v1/realtime/video${key ? `?api_key=${encodeURIComponent(key)}` : ""}`;
    log("connecting");
    ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    ws.onerror = () => log("websocket error (see the browser console)", "error");
    ws.onopen = () => {
      const start = {
        type: "session.start", prompt: $("prompt").value, format: "m4s",
        width: number("width"), height: number("height"), fps: number("fps"), num_frames: number("num-frames"),
        seed: number("seed"),
      };
      if ($("previews").checked) start.extra_params = { previews: true };
      if ($("model").value.trim()) start.model = $("model").value.trim();
      ws.send(JSON.stringify(start));
      setRunning(true);
      log("session.start sent");
    };
    ws.onmessage = (event) => typeof event.data === "string" ? onText(JSON.parse(event.data)) : onBinary(event.data);
    ws.onclose = (event) => { setRunning(false); log(`connection closed (${event.code})`); };
    // A keep-alive, so an idle viewer's session is not ended while the page is open.
    const ping = setInterval(() => ws.readyState === WebSocket.OPEN ? ws.send('{"type":"session.ping"}') : clearInterval(ping), 10000);
  });

  $("stop").addEventListener("click", () => ws && ws.send(JSON.stringify({ type: "session.stop" })));

  $("update-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("update").value.trim();
    if (!ws || !prompt) return;
    ws.send(JSON.stringify({ type: "session.interaction", interaction: { event: { prompt } } }));
  });

  // Start is disabled in the HTML until here: a click before this script ran would submit the form
  // natively and reload the page instead of opening a session.
  $("start").disabled = false;
})();
