# tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts). Scalars by their
# string value (as eq compares them), array references in order, hash references sorted by their entries' texts.
sub __tide_show {
  my ($v) = @_;
  return "undef" unless defined $v;
  my $r = ref $v;
  return "[" . join(",", map { __tide_show($_) } @$v) . "]" if $r eq "ARRAY";
  return "{" . join(",", sort map { __tide_show($_) . "=>" . __tide_show($v->{$_}) } keys %$v) . "}" if $r eq "HASH";
  return "\\" . __tide_show($$v) if $r eq "SCALAR" || $r eq "REF";
  die "tide cannot compare a $r reference\n" if $r;
  my $s = "$v";
  $s =~ s/(["\\])/\\$1/g;
  $s =~ s/([\x00-\x1f\x7f])/sprintf("\\x%02x", ord $1)/ge;
  return "\"$s\"";
}

sub __tide_record {
  my ($path, $i, $get) = @_;
  my $line = eval { "$i\tok\t" . __tide_show($get->()) . "\n" };
  unless (defined $line) { print STDERR $@; $line = "$i\terr\t\n"; }
  open(my $fh, ">>", $path) or die "tide: $path: $!";
  print $fh $line;
  close($fh);
}
1;
