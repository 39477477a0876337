"""GET / on the bootstrap: a self-refreshing page of nodes and recent rooms."""

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["operations"])

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>kvroom status</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; color: #1d2330; }
  h1 { font-size: 1.3rem; } h2 { font-size: 1.05rem; margin-top: 1.5rem; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: .25rem .6rem; border-bottom: 1px solid #dde1e8; }
  th { background: #f2f4f7; font-weight: 600; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .SUCCESS, .alive { color: #1a7f37; } .FAILED, .dead { color: #c62828; }
  .BOOTSTRAPPING, .WAITING_FOR_INPUT, .TRANSFERRING { color: #9a6700; }
  #updated { color: #667085; font-size: .85rem; }
</style>
</head>
<body>
<h1>kvroom</h1>
<div id="updated">loading…</div>
<h2>Nodes</h2>
<table id="nodes"><thead><tr>
  <th>node</th><th>role</th><th>ranks</th><th>state</th><th>rooms in flight</th>
  <th>free pages</th><th>last heartbeat (s)</th></tr></thead><tbody></tbody></table>
<h2>Recent rooms</h2>
<table id="rooms"><thead><tr>
  <th>room</th><th>state</th><th>reason</th><th>prefill</th><th>decode</th><th>prompt</th>
  <th>tokens out</th><th>prefill ms</th><th>transfer ms</th><th>decode ms</th></tr></thead>
  <tbody></tbody></table>
<script>
const REFRESH_MS = 1000;
function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  return td;
}
// Room ids use 63 bits; JavaScript numbers hold 53. Read them as strings.
function parseRooms(text) { return JSON.parse(text.replace(/"room":\s*(\d+)/g, '"room":"$1"')); }
function ms(t, key) { return key in t ? (t[key] * 1000).toFixed(1) : ""; }
function fill(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows.map(cells => {
    const tr = document.createElement("tr");
    tr.append(...cells);
    return tr;
  }));
}
async function refresh() {
  try {
    const [nodes, rooms] = await Promise.all([
      fetch("nodes").then(r => r.json()), fetch("rooms?limit=50").then(r => r.text()).then(parseRooms)]);
    fill("nodes", nodes.map(n => [
      cell(n.node_id), cell(n.role), cell(n.ranks.map(r => r.rank + " @ " + r.session_id).join(", ")),
      cell(n.alive ? "alive" : "dead", n.alive ? "alive" : "dead"), cell(n.rooms_in_flight, "num"),
      cell(n.free_pages + " / " + n.num_pages, "num"), cell(n.seconds_since_heartbeat, "num")]));
    fill("rooms", rooms.map(r => [
      cell(r.room), cell(r.state, r.state), cell(r.reason), cell(r.prefill.node_id),
      cell(r.decode.node_id), cell(r.prompt_tokens, "num"),
      cell(r.output_ids ? r.output_ids.length : "", "num"), cell(ms(r.timings, "prefill_s"), "num"),
      cell(ms(r.timings, "transfer_s"), "num"), cell(ms(r.timings, "decode_s"), "num")]));
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    document.getElementById("updated").textContent = "bootstrap unreachable: " + err;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def status_page() -> str:
    return PAGE
