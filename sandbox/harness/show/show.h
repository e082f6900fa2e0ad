/* tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Integers
   (bool and char included, as C's == compares them) in decimal, floating point with 17 digits, strings quoted. */
#include <stdio.h>
#include <stdbool.h>
static FILE *tide_values;
static void tide_put_i(long long v) { fprintf(tide_values, "%lld", v); }
static void tide_put_u(unsigned long long v) { fprintf(tide_values, "%llu", v); }
static void tide_put_d(double v) { fprintf(tide_values, "%.17g", v); }
static void tide_put_ld(long double v) { fprintf(tide_values, "%.21Lg", v); }
static void tide_put_s(const char *s) {
  if (!s) { fputs("NULL", tide_values); return; }
  fputc('"', tide_values);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(tide_values, "\\%c", c);
    else if (c < 32 || c == 127) fprintf(tide_values, "\\x%02x", c);
    else fputc(c, tide_values);
  }
  fputc('"', tide_values);
}
#define TIDE_PUT(x) _Generic((x), _Bool: tide_put_i, char: tide_put_i, signed char: tide_put_i, short: tide_put_i, \
  int: tide_put_i, long: tide_put_i, long long: tide_put_i, unsigned char: tide_put_u, unsigned short: tide_put_u, \
  unsigned int: tide_put_u, unsigned long: tide_put_u, unsigned long long: tide_put_u, float: tide_put_d, \
  double: tide_put_d, long double: tide_put_ld, char *: tide_put_s, const char *: tide_put_s)(x)
#define TIDE_RECORD(i, expr) do { __auto_type tide_v = (expr); fprintf(tide_values, "%d\tok\t", (i)); \
  TIDE_PUT(tide_v); fputc('\n', tide_values); fflush(tide_values); } while (0)
