// Load test for a scopewire deployment: each virtual user logs in, subscribes
// to one scope and sends messages one after another (each waits for its
// result), counting the pushes it receives back.
//
//   SCOPEWIRE_URL=ws://127.0.0.1:8765 SCOPEWIRE_EMAIL=you@example.com \
//   SCOPEWIRE_PASSWORD=... SCOPEWIRE_SCOPE=scp_... [SCOPEWIRE_WORKSPACE=wsp_...] \
//   k6 run --vus 10 --duration 30s examples/k6/scopewire.js
//
// SCOPEWIRE_WORKSPACE is needed on a multi-workspace instance.
// SCOPEWIRE_SENDS (default 50) is how many messages one connection sends before
// it closes and the next iteration logs in again.  The run fails (thresholds)
// on any error reply, refused upgrade or failed check.

import ws from "k6/ws";
import { check } from "k6";
import { Counter, Trend } from "k6/metrics";

const URL = __ENV.SCOPEWIRE_URL || "ws://127.0.0.1:8765";
const EMAIL = __ENV.SCOPEWIRE_EMAIL;
const PASSWORD = __ENV.SCOPEWIRE_PASSWORD;
const SCOPE = __ENV.SCOPEWIRE_SCOPE;
const WORKSPACE = __ENV.SCOPEWIRE_WORKSPACE || undefined;  // undefined fields are left out of the JSON
const SENDS = parseInt(__ENV.SCOPEWIRE_SENDS || "50", 10);
const CONNECTION_TIMEOUT_MS = 60000;  // one connection's login, subscribe and sends

if (!EMAIL || !PASSWORD || !SCOPE) {
  throw new Error("set SCOPEWIRE_EMAIL, SCOPEWIRE_PASSWORD and SCOPEWIRE_SCOPE");
}

export const options = {
  vus: 2,
  duration: "10s",
  thresholds: {
    scopewire_errors: ["count==0"],
    checks: ["rate==1"],
  },
};

const sendsOk = new Counter("scopewire_sends_ok");
const errors = new Counter("scopewire_errors");
const events = new Counter("scopewire_events_received");
const sendLatency = new Trend("scopewire_send_ms", true);

export default function () {
  const response = ws.connect(URL, { headers: { "Sec-WebSocket-Protocol": "scopewire.json" } }, (socket) => {
    const pending = {};
    let nextId = 1;
    let remaining = SENDS;

    function call(op, fields, onResult) {
      const id = String(nextId++);
      pending[id] = { op, sentAt: Date.now(), onResult };
      socket.send(JSON.stringify(Object.assign({ op, id, workspace_id: WORKSPACE }, fields)));
    }

    function fail(what) {
      errors.add(1);
      console.error(`scopewire: ${what}`);
      socket.close();
    }

    function sendNext() {
      if (remaining-- <= 0) {
        socket.close();
        return;
      }
      call("message.send", {
        scope_id: SCOPE,
        content: `k6 vu ${__VU} iteration ${__ITER} message ${SENDS - remaining}`,
        client_message_id: `k6-${__VU}-${__ITER}-${remaining}-${Date.now()}`,
      }, () => {
        sendsOk.add(1);
        sendNext();
      });
    }

    socket.on("open", () => {
      call("login", { email: EMAIL, password: PASSWORD, workspace_id: undefined }, () =>
        call("subscribe", { scopes: [{ scope_id: SCOPE }] }, () => sendNext()));
    });

    socket.on("message", (text) => {
      const frame = JSON.parse(text);
      if (frame.type === "event") {
        events.add(1);
        return;
      }
      const request = pending[frame.id];
      delete pending[frame.id];
      if (frame.type === "error" || request === undefined) {
        fail(`${request ? request.op : "unexpected reply"}: ${text}`);
        return;
      }
      if (request.op === "message.send") {
        sendLatency.add(Date.now() - request.sentAt);
      }
      request.onResult(frame.data);
    });

    socket.on("error", (e) => fail(`socket error: ${e.error()}`));
    socket.setTimeout(() => fail("the connection did not finish in time"), CONNECTION_TIMEOUT_MS);
  });
  check(response, { "websocket upgraded (101)": (r) => r && r.status === 101 });
}
