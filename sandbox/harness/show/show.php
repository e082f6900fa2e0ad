<?php
// tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Types kept apart
// as === keeps them (3 and 3.0 differ), arrays with their keys in order, objects by class and properties.
function __tide_show($v) {
  if (is_null($v)) return "null";
  if (is_bool($v)) return $v ? "true" : "false";
  if (is_int($v)) return (string)$v;
  if (is_float($v)) return var_export($v, true);
  if (is_string($v)) return '"' . addcslashes($v, "\0..\37\"\\\177") . '"';
  if (is_array($v)) {
    $parts = [];
    foreach ($v as $k => $x) $parts[] = __tide_show($k) . "=>" . __tide_show($x);
    return "[" . implode(",", $parts) . "]";
  }
  if (is_object($v)) return get_class($v) . __tide_show(get_object_vars($v));
  return gettype($v);
}

function __tide_record($path, $i, $get) {
  try {
    $line = "$i\tok\t" . __tide_show($get()) . "\n";
  } catch (Throwable $e) {
    fwrite(STDERR, (string)$e . "\n");
    $line = "$i\terr\t\n";
  }
  file_put_contents($path, $line, FILE_APPEND);
}
