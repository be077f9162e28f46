# `moe-echo launch`: rank variables, output prefixed line by line, a failing rank stops the others
# quickly with a message naming it, --timeout and the SIGKILL grace period, exit codes, and real
# ranks meeting at the rendezvous. Every case must finish in seconds.

# Runs `moe-echo launch ARGS...`; sets rc, out, err and ms (wall time). The sh scripts below
# separate commands with newlines: a ';' would split the argument list.
function(launch)
  string(TIMESTAMP t0 "%s%f")
  execute_process(COMMAND ${EXE} launch ${ARGN} TIMEOUT 60
                  RESULT_VARIABLE r OUTPUT_VARIABLE o ERROR_VARIABLE e)
  string(TIMESTAMP t1 "%s%f")
  math(EXPR ms "(${t1} - ${t0}) / 1000")
  set(rc ${r} PARENT_SCOPE)
  set(out "${o}" PARENT_SCOPE)
  set(err "${e}" PARENT_SCOPE)
  set(ms ${ms} PARENT_SCOPE)
endfunction()

# expect(WHAT CONDITION...): fails with WHAT unless the if() condition holds.
function(expect what)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "${what}\nrc: ${rc} (${ms} ms)\nstdout:\n${out}\nstderr:\n${err}")
  endif()
endfunction()

function(expect_in text needle what)
  string(FIND "${text}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: '${needle}' not found\nrc: ${rc} (${ms} ms)\nstdout:\n${out}\n"
                        "stderr:\n${err}")
  endif()
endfunction()

# Every rank runs, with its variables, and its lines carry its prefix.
launch(-n 3 -- sh -c "echo hello $RANK of $WORLD_SIZE")
expect("hello: exit code" rc EQUAL 0)
foreach(r 0 1 2)
  expect_in("${out}" "[rank ${r}] hello ${r} of 3\n" "hello")
endforeach()

# torchrun's variables; the GPU machines' three variables set unless the user set them;
# CUDA_VISIBLE_DEVICES untouched; no torchrun agent store (rank 0 hosts the rendezvous).
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env NCCL_NVLS_ENABLE=7 CUDA_VISIBLE_DEVICES=3,5
          TORCHELASTIC_USE_AGENT_STORE=True
          ${EXE} launch -n 2 --master-port 29517 -- sh -c
          "echo $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS $CUDA_VISIBLE_DEVICES $TORCHELASTIC_USE_AGENT_STORE"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
expect("environment: exit code" rc EQUAL 0)
expect_in("${out}" "[rank 1] 1 2 127.0.0.1:29517 7 1 1 3,5 False\n" "environment")

# A failing rank: its exit code, a message naming it, the sleeping rank stopped at once.
launch(-n 3 -- sh -c "if [ $RANK = 1 ]\nthen echo bye >&2\nexit 3\nfi\nsleep 30")
expect("failure: exit code 3 expected" rc EQUAL 3)
expect_in("${err}" "moe-echo launch: rank 1 exited with code 3; stopping the other ranks" "failure")
expect_in("${err}" "[rank 1] bye\n" "failure: the rank's stderr")
expect("failure: the other ranks were not stopped quickly" ms LESS 5000)

# A rank killed by a signal; a rank whose watchdog fired.
launch(-n 2 -- sh -c "if [ $RANK = 0 ]\nthen kill -SEGV $$\nfi\nsleep 30")
expect("signal: exit code 139 expected" rc EQUAL 139)
expect_in("${err}" "rank 0 was killed by signal 11" "signal")
launch(-n 2 -- sh -c "if [ $RANK = 1 ]\nthen exit 124\nfi\nsleep 30")
expect("watchdog: exit code 124 expected" rc EQUAL 124)
expect_in("${err}" "rank 1 exited with code 124 (watchdog timeout" "watchdog")

# --timeout stops hung ranks; ranks that ignore SIGTERM get SIGKILL after --grace.
launch(-n 2 --timeout 1 -- sleep 30)
expect("timeout: exit code 124 expected" rc EQUAL 124)
expect_in("${err}" "moe-echo launch: --timeout 1 s reached; stopping ranks 0, 1" "timeout")
expect("timeout: took too long" ms LESS 5000)
set(ready "${WORK_DIR}/launch_rank0_ignores_term")
file(REMOVE "${ready}")
launch(-n 2 --grace 1 -- sh -c
       "if [ $RANK = 1 ]\nthen while [ ! -e '${ready}' ]\ndo sleep 0.05\ndone\nexit 2\nfi\ntrap '' TERM\ntouch '${ready}'\nsleep 30")
expect("grace: exit code 2 expected" rc EQUAL 2)
expect_in("${err}" "rank 0 still running 1 s after the stop signal; sending SIGKILL" "grace")
expect("grace: took too long" ms LESS 5000)

# Ctrl-C: the launcher forwards SIGINT to every rank once they are ready, and exits 130.
set(int_rank "${WORK_DIR}/launch_int_rank.sh")
set(int_main "${WORK_DIR}/launch_int.sh")
file(WRITE "${int_rank}" "trap 'echo got INT; exit 0' INT\ntouch \"$READY.$RANK\"\nwhile true\ndo sleep 0.05\ndone\n")
file(WRITE "${int_main}" "rm -f \"$READY\".*\n\"$EXE\" launch -n 2 -- sh \"$RANK_SCRIPT\" &\npid=$!\n"
                         "while [ ! -e \"$READY.0\" ] || [ ! -e \"$READY.1\" ]\ndo sleep 0.05\ndone\n"
                         "kill -INT $pid\nwait $pid\necho launch exited with $?\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E env EXE=${EXE} RANK_SCRIPT=${int_rank}
                        READY=${WORK_DIR}/launch_int_ready sh ${int_main}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 30)
foreach(r 0 1)
  expect_in("${out}" "[rank ${r}] got INT\n" "SIGINT")
endforeach()
expect_in("${out}" "launch exited with 130" "SIGINT")
expect_in("${err}" "moe-echo launch: interrupted by SIGINT; forwarding it to the ranks" "SIGINT")

# Lines never interleave: three ranks write 300 long lines each to stdout and stderr at once.
launch(-n 3 -- sh -c
       "s=$(printf %0300d 0)\ni=0\nwhile [ $i -lt 300 ]\ndo echo $RANK:$s\necho $RANK:$s >&2\ni=$((i+1))\ndone")
expect("lines: exit code" rc EQUAL 0)
string(REPEAT "0" 300 zeros)
foreach(stream out err)
  string(REPLACE "\n" ";" lines "${${stream}}")
  set(counts 0 0 0)
  foreach(line IN LISTS lines)
    if(line STREQUAL "")
      continue()
    endif()
    if(NOT line MATCHES "^\\[rank ([0-2])\\] ([0-2]):${zeros}$" OR NOT CMAKE_MATCH_1 EQUAL CMAKE_MATCH_2)
      message(FATAL_ERROR "std${stream}: malformed or interleaved line: '${line}'")
    endif()
    list(GET counts ${CMAKE_MATCH_1} n)
    math(EXPR n "${n} + 1")
    list(REMOVE_AT counts ${CMAKE_MATCH_1})
    list(INSERT counts ${CMAKE_MATCH_1} ${n})
  endforeach()
  list(JOIN counts "," counts)
  expect("std${stream}: 300 lines per rank expected, got ${counts}" counts STREQUAL "300,300,300")
endforeach()

# A last line without a newline is forwarded whole.
launch(-n 1 -- sh -c "printf 'no newline'")
expect_in("${out}" "[rank 0] no newline\n" "partial line")

# A command that cannot run; invalid options.
launch(-n 2 -- moe-echo-no-such-command x)
expect("exec failure: exit code 127 expected" rc EQUAL 127)
expect_in("${err}" "cannot run 'moe-echo-no-such-command'" "exec failure")
launch(-n 0 -- true)
expect("-n 0: exit code 2 expected" rc EQUAL 2)
expect_in("${err}" "nproc = 0 is invalid" "-n 0")
launch(-n 2)
expect("no command: exit code 2 expected" rc EQUAL 2)

# Real ranks: find each other at the rendezvous from the variables alone.
if(DIST_TEST)
  launch(-n 3 --master-port 0 --timeout 60 -- ${DIST_TEST} --gtest_filter=Launched.*)
  expect("rendezvous: exit code" rc EQUAL 0)
  foreach(r 0 1 2)
    expect_in("${out}" "[rank ${r}] rank ${r} of 3: rendezvous ok" "rendezvous")
  endforeach()
endif()
message(STATUS "moe-echo launch: all cases passed")
