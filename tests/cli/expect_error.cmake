# `moe-echo bench --top-k 0` must exit with code 2 (invalid configuration) and a message that
# names top_k, its value and what is allowed.
execute_process(COMMAND ${EXE} bench --top-k 0 --steps 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "2")
  message(FATAL_ERROR "expected exit code 2, got ${rc}\nstdout: ${out}\nstderr: ${err}")
endif()
if(NOT err MATCHES "top_k = 0 is invalid: allowed 1 <= top_k <= experts \\(16\\)")
  message(FATAL_ERROR "the error does not name top_k, its value and the range: ${err}")
endif()
message(STATUS "exit ${rc}: ${err}")
