// tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Whole numbers in
// decimal, floating point as Double.toString of the double value (as == promotes), characters and strings
// quoted, lists and arrays in order, sets and maps sorted by their elements' texts, Optional; others toString.
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.lang.reflect.Array;
import java.util.*;
import java.util.function.Supplier;

final class TideShow {
  static String quote(String s, char q) {
    StringBuilder b = new StringBuilder().append(q);
    for (char c : s.toCharArray()) {
      if (c == q || c == '\\') b.append('\\').append(c);
      else if (c < 32 || c == 127) b.append(String.format("\\u%04x", (int) c));
      else b.append(c);
    }
    return b.append(q).toString();
  }

  static String join(List<String> parts, boolean sorted, String open, String close) {
    if (sorted) Collections.sort(parts);
    return open + String.join(",", parts) + close;
  }

  static String show(Object v) {
    if (v == null) return "null";
    if (v instanceof Boolean) return v.toString();
    if (v instanceof Double || v instanceof Float) return Double.toString(((Number) v).doubleValue());
    if (v instanceof Number) return v.toString();
    if (v instanceof Character) return quote(v.toString(), '\'');
    if (v instanceof CharSequence) return quote(v.toString(), '"');
    if (v instanceof Optional) return ((Optional<?>) v).map(x -> "Optional[" + show(x) + "]").orElse("Optional.empty");
    if (v instanceof Map) {
      List<String> p = new ArrayList<>();
      for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) p.add(show(e.getKey()) + "=" + show(e.getValue()));
      return join(p, true, "{", "}");
    }
    if (v instanceof Set) {
      List<String> p = new ArrayList<>();
      for (Object x : (Set<?>) v) p.add(show(x));
      return join(p, true, "{", "}");
    }
    if (v instanceof Iterable) {
      List<String> p = new ArrayList<>();
      for (Object x : (Iterable<?>) v) p.add(show(x));
      return join(p, false, "[", "]");
    }
    if (v.getClass().isArray()) {
      List<String> p = new ArrayList<>();
      for (int i = 0; i < Array.getLength(v); i++) p.add(show(Array.get(v, i)));
      return join(p, false, "[", "]");
    }
    return quote(String.valueOf(v), '"');
  }

  static PrintStream out;

  static void record(String path, int i, Supplier<Object> get) {
    String line;
    try {
      line = i + "\tok\t" + show(get.get()) + "\n";
    } catch (Throwable e) {
      e.printStackTrace();
      line = i + "\terr\t\n";
    }
    try {
      if (out == null) out = new PrintStream(new FileOutputStream(path, true), true, "UTF-8");
    } catch (java.io.IOException e) {
      throw new RuntimeException(e);
    }
    out.print(line);
    out.flush();
  }
}
