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

# Precision fp8 at the defaults (the tiny preset: H 64, F 128, 256 tokens, EP 4, hot experts of
# row counts no multiple of 128): each step's results with ECHO on equal those with it off up to
# the order of sums, so the curves agree within 1e-5 over the first steps, before e4m3 rounding
# makes whole e4m3 steps of last-bit differences (docs/fp8.md, "ECHO under FP8"). 8 steps do not
# halve the loss: only the verdict counts here. With clones splitting an expert's rows at any row,
# its weight-gradient tiles differed and step 2 was 9e-5 apart.
execute_process(COMMAND ${EXE} train --precision fp8 --steps 8 --tolerance 1e-5
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT out MATCHES "ECHO on vs off: max relative difference [0-9.e+-]+ \\(tolerance 1e-05\\): agree")
  message(FATAL_ERROR "train --precision fp8 --steps 8: ECHO on and off disagree (${rc}):\n"
                      "${out}\n${err}")
endif()

# A JSON number, plain (0.0021) or with a negative exponent (2.1e-03), as an integer count of
# 1e-12 (CMake has no floats).
function(to_pico value out)
  set(exp 0)
  set(m "${value}")
  if(value MATCHES "^([0-9.]+)[eE]-([0-9]+)$")
    set(m "${CMAKE_MATCH_1}")
    math(EXPR exp "${CMAKE_MATCH_2}")
  endif()
  if(NOT m MATCHES "^([0-9]+)\\.?([0-9]*)$")
    message(FATAL_ERROR "not a loss value: ${value}")
  endif()
  set(int "${CMAKE_MATCH_1}")
  set(frac "${CMAKE_MATCH_2}000000000000000000000000")
  # value = int.frac * 10^-exp: shift the digits right by exp places, keep 12 after the point.
  string(REPEAT "0" ${exp} zeros)
  set(digits "${zeros}${int}${frac}")
  string(LENGTH "${zeros}${int}" point)
  math(EXPR point "${point} - ${exp}")
  math(EXPR take "${point} + 12")
  string(SUBSTRING "${digits}" 0 ${take} kept)
  string(REGEX REPLACE "^0+" "" kept "${kept}")
  if(kept STREQUAL "")
    set(kept 0)
  endif()
  set(${out} ${kept} PARENT_SCOPE)
endfunction()
# Precision fp8 trains like bf16: the mean loss of the last 20 steps within 1% (a single step's
# loss moves by a few percent with its batch; e4m3 GEMM operands with blockwise scales; on the
# CPU backend the FP8 references, bf16 meaning the f32 CPU GEMMs).
foreach(p bf16 fp8)
  execute_process(COMMAND ${EXE} train --precision ${p} --hidden 64 --ffn 64 --steps 150 --echo on
                          --json ${WORK_DIR}/train_${p}.json
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES ": falls")
    message(FATAL_ERROR "train --precision ${p} failed (${rc}):\n${out}\n${err}")
  endif()
  file(READ ${WORK_DIR}/train_${p}.json j)
  string(JSON n LENGTH "${j}" loss_echo)
  math(EXPR first "${n} - 20")
  math(EXPR last "${n} - 1")
  set(sum 0)
  foreach(i RANGE ${first} ${last})
    string(JSON v GET "${j}" loss_echo ${i})
    to_pico(${v} pv)
    math(EXPR sum "${sum} + ${pv}")
  endforeach()
  math(EXPR mean_${p} "${sum} / 20")
endforeach()
set(f ${mean_fp8})
set(b ${mean_bf16})
math(EXPR diff "${f} - ${b}")
if(diff LESS 0)
  math(EXPR diff "0 - ${diff}")
endif()
math(EXPR limit "${b} / 100")
if(b EQUAL 0 OR diff GREATER limit)
  message(FATAL_ERROR "train --precision fp8: mean loss of the last 20 steps ${f}e-12, bf16 "
                      "${b}e-12: more than 1% apart")
endif()
message(STATUS "mean loss of the last 20 steps: fp8 ${f}e-12, bf16 ${b}e-12")
