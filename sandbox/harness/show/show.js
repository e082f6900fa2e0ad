// tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts).
function __tideShow(v) {
  if (v === null) return "null";
  if (v === undefined) return "undefined";
  switch (typeof v) {
    case "number": return Object.is(v, -0) ? "0" : String(v);
    case "bigint": return v + "n";
    case "string": return JSON.stringify(v);
    case "boolean": return String(v);
    case "function": case "symbol": throw new TypeError("tide cannot compare a " + typeof v);
  }
  if (Array.isArray(v) || ArrayBuffer.isView(v)) return "[" + Array.from(v, __tideShow).join(",") + "]";
  if (v instanceof Map) return "Map{" + [...v].map(([k, x]) => __tideShow(k) + ":" + __tideShow(x)).sort().join(",") + "}";
  if (v instanceof Set) return "Set{" + [...v].map(__tideShow).sort().join(",") + "}";
  if (v instanceof Date) return "Date(" + v.toISOString() + ")";
  return "{" + Object.keys(v).sort().map((k) => JSON.stringify(k) + ":" + __tideShow(v[k])).join(",") + "}";
}
function __tideRecord(path, i, get) {
  let line;
  try { line = i + "\tok\t" + __tideShow(get()) + "\n"; }
  catch (e) { console.error(e && e.stack ? e.stack : String(e)); line = i + "\terr\t\n"; }
  require("fs").appendFileSync(path, line);
}
