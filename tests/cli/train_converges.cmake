# `moe-echo train` exits 0 only when the loss falls to half and the ECHO on/off curves agree;
# a loss that goes bad ends the run with exit 1; one run compares nothing and says so.
execute_process(COMMAND ${EXE} train --steps 50 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "train failed (${rc}):\n${out}\n${err}")
endif()
if(NOT out MATCHES ": falls" OR NOT out MATCHES ": agree")
  message(FATAL_ERROR "unexpected verdict:\n${out}")
endif()

# A loss that goes bad ends the run: exit 1, a message naming the run, the step and the loss.
execute_process(COMMAND ${EXE} train --lr 1e10 --steps 10 RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc STREQUAL "1" OR NOT err MATCHES "train \\(ECHO on\\): the loss of step [0-9]+ is -?nan")
  message(FATAL_ERROR "--lr 1e10: expected exit 1 naming the step of the NaN loss, got ${rc}:\n"
                      "${out}\n${err}")
endif()
if(out MATCHES "agree")
  message(FATAL_ERROR "--lr 1e10: a diverged run claims agreement:\n${out}")
endif()

# One run compares nothing and claims nothing: "not compared", JSON curves_agree null.
set(json_file ${WORK_DIR}/train_echo_on.json)
execute_process(COMMAND ${EXE} train --echo on --steps 3 --json ${json_file}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT out MATCHES "ECHO on vs off: not compared" OR out MATCHES ": agree")
  message(FATAL_ERROR "--echo on: expected 'not compared':\n${out}\n${err}")
endif()
file(READ ${json_file} j)
string(JSON agree TYPE "${j}" curves_agree)
string(JSON compared GET "${j}" compared)
if(NOT agree STREQUAL "NULL" OR compared)
  message(FATAL_ERROR "--echo on: curves_agree must be null and compared false: ${j}")
endif()
