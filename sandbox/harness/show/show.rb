# tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Numbers as ==
# compares them (a whole float as its integer), strings and symbols by inspect, arrays in order, hashes and sets
# sorted by their elements' texts.
def __tide_show(v)
  case v
  when nil, true, false, Integer then v.inspect
  when Float then v.finite? && v == v.round && v.abs < 1e15 ? v.round.to_s : v.to_s
  when String, Symbol then v.inspect
  when Array then "[" + v.map { |x| __tide_show(x) }.join(",") + "]"
  when Hash then "{" + v.map { |k, x| __tide_show(k) + "=>" + __tide_show(x) }.sort.join(",") + "}"
  else
    if defined?(Set) && v.is_a?(Set) then "Set{" + v.map { |x| __tide_show(x) }.sort.join(",") + "}"
    else v.inspect.gsub("\n", "\\n") end
  end
end

def __tide_record(path, i)
  line = begin
    "#{i}\tok\t#{__tide_show(yield)}\n"
  rescue Exception => e
    $stderr.puts e.full_message
    "#{i}\terr\t\n"
  end
  File.open(path, "a") { |f| f.write(line) }
end
