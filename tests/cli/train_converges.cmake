# `moe-echo train` exits 0 only when the loss falls to half and the ECHO on/off curves agree.
execute_process(COMMAND ${EXE} train --steps 50 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "train failed (${rc}):\n${out}\n${err}")
endif()
if(NOT out MATCHES ": falls" OR NOT out MATCHES ": agree")
  message(FATAL_ERROR "unexpected verdict:\n${out}")
endif()
