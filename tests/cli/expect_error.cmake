# `moe-echo bench --top-k 0` must exit non-zero with a message that names top_k.
execute_process(COMMAND ${EXE} bench --top-k 0 --steps 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a non-zero exit, got 0\nstdout: ${out}\nstderr: ${err}")
endif()
if(NOT err MATCHES "top_k")
  message(FATAL_ERROR "the error does not name top_k: ${err}")
endif()
message(STATUS "exit ${rc}: ${err}")
