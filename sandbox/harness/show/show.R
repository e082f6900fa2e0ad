# tide tests mode: the canonical text of a value (sandbox/value_tests.py compares these texts): deparse with
# 17 significant digits, names and attributes; integer and double vectors of the same values alike (as == sees).
.tide_show <- function(v) paste(deparse(v, control = c("keepNA", "niceNames", "showAttributes", "digits17")),
                                collapse = " ")

.tide_record <- function(path, i, get) {
  line <- tryCatch(paste0(i, "\tok\t", .tide_show(get()), "\n"),
                   error = function(e) { message(conditionMessage(e)); paste0(i, "\terr\t\n") })
  cat(line, file = path, append = TRUE)
}
