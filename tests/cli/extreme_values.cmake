# Every numeric option of one `moe-echo` command at its extremes. The options are read from
# `moe-echo CMD --help` (each option whose value is an INT, UINT or FLOAT), so a new option is
# covered without a word here; each is run with each of VALUES below, after BASE (arguments that
# keep an accepted run short, left out where they name the option under test) and before TAIL.
# Then a few products of two options that overflow (PAIRS, "flag value flag value").
#
# A case passes when the command exits 0, or exits 1 or 2 with "moe-echo: error:" and a message
# that names the option (its parameter name, its flag, or the field it sets), within 60 s: never a
# signal (a crash, an out-of-memory kill), a hang, or an unnamed error. `train` may also exit 1
# with its verdict ("DOES NOT FALL", "DISAGREE"), and `launch` exit 124 when its --timeout is
# reached (docs/launch.md). Every failing case is listed.
#
# -DEXE=moe-echo -DCMD=bench -DBASE=--steps,1 [-DTAIL=--,true]
#   [-DPAIRS="--tokens 2147483647 --top-k 8|..."] -DWORK_DIR=scratch folder
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)
set(VALUES 0 1 -1 2 2147483647 2147483648 -2147483648 9223372036854775807 18446744073709551615
           -9223372036854775808 1e308 -1e308 1e-300 nan inf -inf)
# Older or shorter flags and the names their messages use.
set(ALIASES "tokens=max_tokens" "score=score_function" "aux_loss=aux_loss_coeff"
            "z_loss=z_loss_coeff" "routed_scaling=routed_scaling_factor"
            "seq_aux_loss=seq_aux_loss_coeff" "spare_slots=spare_slots_per_rank"
            "max_clones=max_clones_per_expert" "ep=ep_size" "n=nproc" "max_tokens=tokens"
            "max_tokens=memory" "tokens=memory" "hidden=memory" "ffn=memory" "experts=memory"
            "ep=memory" "layers=memory" "steps=memory" "threads=memory" "sim_steps=memory"
            "sim_layers=memory" "in_flight=memory" "shared_experts=memory" "shared_ffn=memory"
            "spare_slots=memory" "capacity_factor=memory" "chunks=memory" "max_clones=memory")
string(REPLACE "," ";" BASE "${BASE}")
string(REPLACE "," ";" TAIL "${TAIL}")
string(REPLACE "|" ";" PAIRS "${PAIRS}")
file(MAKE_DIRECTORY ${WORK_DIR})

execute_process(COMMAND ${EXE} ${CMD} --help RESULT_VARIABLE rc OUTPUT_VARIABLE help
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${CMD} --help failed (${rc}): ${err}")
endif()
# "  --top-k INT  ...", "  -n,--nproc INT REQUIRED ...", "  --zipf FLOAT ..." (matched in the
# whole text: the help's own semicolons and brackets would split or join list items)
string(REGEX MATCHALL "\n +(-[a-zA-Z],)?--[a-z0-9-]+ (INT|UINT|FLOAT)" options "\n${help}")
set(flags "")
foreach(o IN LISTS options)
  string(REGEX MATCH "--[a-z0-9-]+" flag "${o}")
  list(APPEND flags ${flag})
endforeach()
list(REMOVE_DUPLICATES flags)
list(LENGTH flags nflags)
if(nflags LESS 2)
  message(FATAL_ERROR "${CMD} --help lists ${nflags} numeric options:\n${help}")
endif()

# The names a message may use for `flag`: its parameter name and ALIASES, as words.
function(names_of flag out)
  string(REGEX REPLACE "^-+" "" p "${flag}")
  string(REPLACE "-" "_" p "${p}")
  set(n "${p}")
  foreach(a IN LISTS ALIASES)
    string(REPLACE "=" ";" pair "${a}")
    list(GET pair 0 from)
    list(GET pair 1 to)
    if(from STREQUAL p)
      list(APPEND n "${to}")
    endif()
  endforeach()
  set(${out} "${n}" PARENT_SCOPE)
endfunction()

# `args` without the options in `drop` (and their values).
function(without args drop out)
  set(kept "")
  set(skip FALSE)
  foreach(a IN LISTS args)
    if(skip)
      set(skip FALSE)
    elseif(a IN_LIST drop)
      set(skip TRUE)
    elseif(NOT a STREQUAL "")
      list(APPEND kept "${a}")
    endif()
  endforeach()
  set(${out} "${kept}" PARENT_SCOPE)
endfunction()

set(total 0)
set(failed 0)
set(report "")
set(slowest 0)
set(slowest_case "")
# Runs one case: `tested` the flags under test (their names must appear in an error).
macro(run_case tested args)
  set(argv "")
  foreach(a IN ITEMS ${args})
    if(NOT a STREQUAL "")
      list(APPEND argv "${a}")
    endif()
  endforeach()
  math(EXPR total "${total} + 1")
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${EXE} ${CMD} ${argv} TIMEOUT 60 WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  if(dt GREATER slowest)
    set(slowest ${dt})
    set(slowest_case "${argv}")
  endif()
  set(why "")
  if(NOT rc MATCHES "^[0-9]+$")
    set(why "ended by: ${rc}")
  elseif(rc EQUAL 0)
  elseif(rc EQUAL 1 OR rc EQUAL 2 OR (CMD STREQUAL "launch" AND rc EQUAL 124))
    string(FIND "${err}" "moe-echo: error: " has_prefix)
    set(named FALSE)
    foreach(f IN ITEMS ${tested})
      string(FIND "${err}" "${f}" at)
      if(NOT at EQUAL -1)
        set(named TRUE)
      endif()
      names_of(${f} names)
      foreach(n IN LISTS names)
        if(err MATCHES "(^|[^a-z_])${n}([^a-z_]|$)")
          set(named TRUE)
        endif()
      endforeach()
    endforeach()
    if(CMD STREQUAL "launch" AND rc EQUAL 124)  # --timeout reached: "moe-echo launch: --timeout"
      set(has_prefix 0)
    endif()
    if(CMD STREQUAL "train" AND rc EQUAL 1 AND has_prefix EQUAL -1
       AND (out MATCHES "DOES NOT FALL" OR out MATCHES "DISAGREE"))
      set(named TRUE)
      set(has_prefix 0)
    endif()
    if(has_prefix EQUAL -1 OR NOT named)
      set(why "exit ${rc} without an error naming ${tested}")
    endif()
  else()
    set(why "exit ${rc} (want 0, 1 or 2)")
  endif()
  if(why)
    math(EXPR failed "${failed} + 1")
    string(APPEND report "\n  moe-echo ${CMD} ${argv}\n    ${why}\n    stderr: ${err}")
  endif()
endmacro()

foreach(flag IN LISTS flags)
  without("${BASE}" "${flag}" base)
  foreach(v IN LISTS VALUES)
    run_case("${flag}" "${base};${flag};${v};${TAIL}")
  endforeach()
endforeach()

# Products of two options (PAIRS: "flag value flag value" entries).
foreach(pair IN LISTS PAIRS)
  separate_arguments(p UNIX_COMMAND "${pair}")
  list(GET p 0 f1)
  list(GET p 2 f2)
  without("${BASE}" "${f1};${f2}" base)
  run_case("${f1};${f2}" "${base};${p};${TAIL}")
endforeach()

if(failed GREATER 0)
  message(FATAL_ERROR "${failed} of ${total} cases of moe-echo ${CMD} at extreme values "
                      "crashed, hung or failed without naming the option:${report}")
endif()
message(STATUS "${total} cases of moe-echo ${CMD} (${nflags} numeric options) exited cleanly; "
               "slowest ${slowest} s: ${slowest_case}")
