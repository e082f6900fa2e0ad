# tide tests mode: a word's value as bash's printf %q quotes it (sandbox/value_tests.py compares these texts).
__tide_record() { printf '%s\tok\t%q\n' "$2" "$3" >> "$1"; }
