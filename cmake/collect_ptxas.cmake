# Concatenates the per-object ptxas reports written by ptxas_log.sh into one file.
file(GLOB_RECURSE _logs "${DIR}/*.ptxas")
list(SORT _logs)
file(WRITE "${OUT}" "")
foreach(_log IN LISTS _logs)
  file(READ "${_log}" _text)
  file(APPEND "${OUT}" "# ${_log}\n${_text}")
endforeach()
