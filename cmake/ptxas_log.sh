#!/usr/bin/env bash
# CUDA compiler launcher: runs the nvcc command unchanged and keeps its stderr (the -Xptxas -v
# resource report) in <object>.ptxas next to the object file, so tests can check for spills.
# Everything that is not a ptxas info line (warnings, errors) is still shown.
out=""
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  prev="$a"
done
if [ -z "$out" ]; then exec "$@"; fi
"$@" 2>"${out}.ptxas"
rc=$?
grep -v -e "^ptxas info" -e "bytes stack frame" "${out}.ptxas" >&2
exit $rc
