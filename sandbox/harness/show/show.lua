-- tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Numbers as ==
-- compares them (a whole float as its integer), strings quoted, tables by their entries sorted by text.
local function tide_show(v)
  local t = type(v)
  if t == "nil" or t == "boolean" then return tostring(v) end
  if t == "number" then
    if math.type(v) == "integer" then return tostring(v) end
    if v == math.floor(v) and v > -2^53 and v < 2^53 then return string.format("%d", math.tointeger(v)) end
    return string.format("%.17g", v)
  end
  if t == "string" then
    return '"' .. v:gsub('[%c"\\]', function(c) return string.format("\\%03d", c:byte()) end) .. '"'
  end
  if t == "table" then
    local parts = {}
    for k, x in pairs(v) do parts[#parts + 1] = tide_show(k) .. "=" .. tide_show(x) end
    table.sort(parts)
    return "{" .. table.concat(parts, ",") .. "}"
  end
  error("tide cannot compare a " .. t)
end

function __tide_record(path, i, get)
  local ok, text = pcall(function() return tide_show(get()) end)
  if not ok then io.stderr:write(tostring(text), "\n") end
  local f = assert(io.open(path, "a"))
  f:write(i, "\t", ok and "ok" or "err", "\t", ok and text or "", "\n")
  f:close()
end
