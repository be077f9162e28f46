# `moe-echo bench --layers`: three layers on one MoeStack, three separate MoeLayers, and the stack
# run as split-phase calls with --overlap wgrad compute the same steps (identical load statistics),
# each allocates what was estimated before building, the stack less than the separate layers (one
# workspace instead of three), and the JSON holds the documented layer and memory fields.
cmake_policy(SET CMP0054 NEW)
foreach(mode stack separate split)
  set(json_file ${WORK_DIR}/bench_layers_${mode}.json)
  set(args bench --ep 2 --layers 3 --recompute experts --steps 2 --json ${json_file})
  if(mode STREQUAL "separate")
    list(APPEND args --separate)
  endif()
  if(mode STREQUAL "split")
    list(APPEND args --split-phases --overlap wgrad)
  endif()
  execute_process(COMMAND ${EXE} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "bench ${mode} failed (${rc}): ${out}\n${err}")
  endif()
  if(NOT out MATCHES "ms per layer" OR NOT out MATCHES "MoE memory per rank")
    message(FATAL_ERROR "bench ${mode}: no step time per layer or memory printed: ${out}")
  endif()
  file(READ ${json_file} j)
  string(JSON layers GET "${j}" config layers)
  string(JSON recompute GET "${j}" config recompute)
  string(JSON json_separate GET "${j}" config separate)
  set(want_separate OFF)
  if(mode STREQUAL "separate")
    set(want_separate ON)
  endif()
  if(NOT layers EQUAL 3 OR NOT recompute STREQUAL "experts"
     OR NOT json_separate STREQUAL want_separate)
    message(FATAL_ERROR "bench ${mode}: config.layers ${layers}, config.recompute ${recompute}, "
                        "config.separate ${json_separate}")
  endif()
  foreach(field moe_bytes_per_rank workspace_bytes layers_bytes bytes_per_layer estimate_bytes)
    string(JSON ${mode}_${field} ERROR_VARIABLE e GET "${j}" memory ${field})
    if(e)
      message(FATAL_ERROR "bench ${mode}: memory.${field} missing: ${e}")
    endif()
  endforeach()
  foreach(field step_ms step_ms_per_layer moe_bytes_per_rank load_max_over_mean_echo)
    string(JSON ${mode}_summary_${field} ERROR_VARIABLE e GET "${j}" summary ${field})
    if(e)
      message(FATAL_ERROR "bench ${mode}: summary.${field} missing: ${e}")
    endif()
  endforeach()
  string(JSON per_step_layers LENGTH "${j}" steps 0 layers)
  if(NOT per_step_layers EQUAL 3)
    message(FATAL_ERROR "bench ${mode}: steps[0].layers has ${per_step_layers} entries, not 3")
  endif()
  math(EXPR sum "${${mode}_workspace_bytes} + ${${mode}_layers_bytes}")
  if(NOT sum EQUAL ${mode}_moe_bytes_per_rank)
    message(FATAL_ERROR "bench ${mode}: workspace + layers = ${sum}, allocated "
                        "${${mode}_moe_bytes_per_rank}")
  endif()
  if(NOT ${mode}_estimate_bytes EQUAL ${mode}_moe_bytes_per_rank)
    message(FATAL_ERROR "bench ${mode}: estimated ${${mode}_estimate_bytes} bytes, allocated "
                        "${${mode}_moe_bytes_per_rank}")
  endif()
endforeach()
if(NOT stack_moe_bytes_per_rank LESS separate_moe_bytes_per_rank)
  message(FATAL_ERROR "the stack allocates ${stack_moe_bytes_per_rank} bytes, not less than the "
                      "separate layers' ${separate_moe_bytes_per_rank}")
endif()
if(NOT stack_layers_bytes EQUAL separate_layers_bytes)
  message(FATAL_ERROR "the layers' own parts differ: stack ${stack_layers_bytes}, separate "
                      "${separate_layers_bytes}")
endif()
if(NOT stack_summary_load_max_over_mean_echo STREQUAL separate_summary_load_max_over_mean_echo)
  message(FATAL_ERROR "stack and separate layers routed differently: max/mean "
                      "${stack_summary_load_max_over_mean_echo} and "
                      "${separate_summary_load_max_over_mean_echo}")
endif()
# The split-phase calls with overlap wgrad: the stack's steps (same loads, same memory).
if(NOT split_summary_load_max_over_mean_echo STREQUAL stack_summary_load_max_over_mean_echo OR
   NOT split_moe_bytes_per_rank EQUAL stack_moe_bytes_per_rank)
  message(FATAL_ERROR "split phases with overlap: max/mean ${split_summary_load_max_over_mean_echo}"
                      ", ${split_moe_bytes_per_rank} bytes; the stack's "
                      "${stack_summary_load_max_over_mean_echo}, ${stack_moe_bytes_per_rank}")
endif()
string(JSON split_phases GET "${j}" config split_phases)
string(JSON split_overlap GET "${j}" config overlap)
if(NOT split_phases STREQUAL "ON" OR NOT split_overlap STREQUAL "wgrad")
  message(FATAL_ERROR "split: config.split_phases ${split_phases}, config.overlap ${split_overlap}")
endif()
message(STATUS "3 layers: stack ${stack_moe_bytes_per_rank} bytes per rank, separate "
               "${separate_moe_bytes_per_rank}")
