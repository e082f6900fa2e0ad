// tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Numbers as C++'s
// == compares them (bool and char as integers, floating point with 17 digits), strings quoted, sequences in
// order, sets and maps sorted by their elements' texts, pairs/tuples, optionals; other types through operator<<.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>
#include <list>
#include <deque>
#include <array>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <tuple>
#include <optional>
#include <utility>
#include <sstream>
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <stdexcept>

namespace tide_show {
template <class T, class = void> struct is_iterable : std::false_type {};
template <class T> struct is_iterable<T, std::void_t<decltype(std::begin(std::declval<const T&>())),
                                                     decltype(std::end(std::declval<const T&>()))>> : std::true_type {};
template <class T, class = void> struct has_key : std::false_type {};
template <class T> struct has_key<T, std::void_t<typename T::key_type>> : std::true_type {};
template <class T, class = void> struct has_mapped : std::false_type {};
template <class T> struct has_mapped<T, std::void_t<typename T::mapped_type>> : std::true_type {};
template <class T, class = void> struct streamable : std::false_type {};
template <class T> struct streamable<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};
template <class T> struct is_pair : std::false_type {};
template <class A, class B> struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T> struct is_tuple : std::false_type {};
template <class... A> struct is_tuple<std::tuple<A...>> : std::true_type {};
template <class T> struct is_optional : std::false_type {};
template <class A> struct is_optional<std::optional<A>> : std::true_type {};

inline std::string quote(std::string_view s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') { o += '\\'; o += (char)c; }
    else if (c < 32 || c == 127) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", c); o += b; }
    else o += (char)c;
  }
  return o + "\"";
}

template <class T> std::string show(const T& v);

template <class C> std::string joined(const C& parts, bool sorted, const char* open, const char* close) {
  std::vector<std::string> p(parts.begin(), parts.end());
  if (sorted) std::sort(p.begin(), p.end());
  std::string o = open;
  for (size_t i = 0; i < p.size(); i++) { if (i) o += ","; o += p[i]; }
  return o + close;
}

template <class T> std::string show(const T& v) {
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, char> || std::is_same_v<T, signed char> ||
                std::is_same_v<T, unsigned char>) {
    return std::to_string((int)v);
  } else if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) {
    return std::to_string(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    char b[64];
    std::snprintf(b, sizeof b, "%.17Lg", (long double)(double)v);
    return b;
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    return quote(std::string_view(v));
  } else if constexpr (is_pair<T>::value) {
    return "(" + show(v.first) + "," + show(v.second) + ")";
  } else if constexpr (is_tuple<T>::value) {
    std::vector<std::string> p;
    std::apply([&](const auto&... x) { (p.push_back(show(x)), ...); }, v);
    return joined(p, false, "(", ")");
  } else if constexpr (is_optional<T>::value) {
    return v ? "some(" + show(*v) + ")" : "nullopt";
  } else if constexpr (has_key<T>::value && has_mapped<T>::value) {
    std::vector<std::string> p;
    for (const auto& kv : v) p.push_back(show(kv.first) + ":" + show(kv.second));
    return joined(p, true, "{", "}");
  } else if constexpr (has_key<T>::value) {
    std::vector<std::string> p;
    for (const auto& x : v) p.push_back(show(x));
    return joined(p, true, "{", "}");
  } else if constexpr (is_iterable<T>::value) {
    std::vector<std::string> p;
    for (const auto& x : v) p.push_back(show(x));
    return joined(p, false, "[", "]");
  } else if constexpr (std::is_pointer_v<T> || std::is_null_pointer_v<T>) {
    static_assert(!std::is_same_v<T, T>, "tide cannot compare pointers");
  } else {
    static_assert(streamable<T>::value, "tide cannot show this type: give it an operator<<");
    std::ostringstream s;
    s << v;
    return quote(s.str());
  }
}

template <class F> void record(std::FILE* f, long i, F get) {
  std::string text;
  const char* status = "ok";
  try { text = show(get()); }
  catch (const std::exception& e) { status = "err"; std::fprintf(stderr, "test %ld: %s\n", i, e.what()); }
  catch (...) { status = "err"; }
  std::fprintf(f, "%ld\t%s\t", i, status);
  std::fwrite(text.data(), 1, status[0] == 'o' ? text.size() : 0, f);
  std::fputc('\n', f);
  std::fflush(f);
}
}  // namespace tide_show
