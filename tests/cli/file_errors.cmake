# Files that cannot be written or read are named, with the system's reason, and the command exits
# non-zero: an output in a folder that does not exist is refused before the run (exit 2, the
# option and the path); a write that fails after it, to /dev/full (a full disk), exits 1 with
# "cannot write '/dev/full': No space left on device"; a trace or measured-results file that is a
# folder exits 2 naming the path and "Is a directory". Each case: `exit|text on stderr|arguments`.
set(cases
    "2|json = '/no/such/folder/b.json'|bench --steps 1 --tokens 8 --json /no/such/folder/b.json"
    "2|json = '/no/such/folder/t.json'|train --steps 2 --tokens 8 --json /no/such/folder/t.json"
    "2|json = '/no/such/folder/s.json'|simulate --steps 2 --layers 1 --json /no/such/folder/s.json"
    "2|plot = '/no/such/folder/s.svg'|simulate --steps 2 --layers 1 --plot /no/such/folder/s.svg"
    "2|write_trace = '/no/such/folder/t.csv'|simulate --steps 2 --layers 1 --write-trace /no/such/folder/t.csv"
    "2|json = '/no/such/folder/p.json'|plan --imbalance 1.2 --json /no/such/folder/p.json"
    "1|cannot write '/dev/full': No space left on device|bench --steps 1 --tokens 8 --json /dev/full"
    "1|cannot write '/dev/full': No space left on device|train --steps 2 --tokens 8 --echo on --json /dev/full"
    "1|cannot write '/dev/full': No space left on device|simulate --steps 2 --layers 1 --json /dev/full"
    "1|cannot write '/dev/full': No space left on device|simulate --steps 2 --layers 1 --plot /dev/full"
    "1|cannot write '/dev/full': No space left on device|simulate --steps 2 --layers 1 --write-trace /dev/full"
    "1|cannot write '/dev/full': No space left on device|plan --imbalance 1.2 --json /dev/full"
    "2|cannot open the file: Is a directory|simulate --steps 2 --trace @WORK@"
    "2|cannot open the file: No such file or directory|plan --trace @WORK@/no_such_trace.csv"
    "2|measured = '@WORK@' is invalid: allowed a measured-results JSON file this user can read (cannot open it: Is a directory)|simulate --measured @WORK@")
file(MAKE_DIRECTORY ${WORK_DIR})
if(NOT EXISTS /dev/full)
  message(STATUS "no /dev/full: the cases of a failed write are skipped")
endif()
set(failed "")
foreach(c IN LISTS cases)
  string(REPLACE "@WORK@" "${WORK_DIR}" c "${c}")
  string(REPLACE "|" ";" parts "${c}")
  list(GET parts 0 want_rc)
  list(GET parts 1 want)
  list(GET parts 2 args)
  if(args MATCHES "/dev/full" AND NOT EXISTS /dev/full)
    continue()
  endif()
  separate_arguments(argv UNIX_COMMAND "${args}")
  execute_process(COMMAND ${EXE} ${argv} TIMEOUT 60 WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(FIND "${err}" "moe-echo: error: " has_prefix)
  string(FIND "${err}" "${want}" has_want)
  if(NOT rc STREQUAL want_rc OR has_prefix EQUAL -1 OR has_want EQUAL -1)
    string(APPEND failed "\n  moe-echo ${args}\n    exit ${rc}, want ${want_rc}\n"
                         "    want on stderr: ${want}\n    stderr: ${err}")
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "files not named, or the wrong exit:${failed}")
endif()
list(LENGTH cases n)
message(STATUS "${n} unreadable or unwritable files named with the reason")
