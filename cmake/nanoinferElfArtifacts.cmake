# Turns cargo's ELF outputs into the libraries the package installs.
# Run as a script: cmake -DNI_MODE=static|shared -DNI_INPUT=... -DNI_OUTPUT=...
#   [-DNI_DEBUG_OUTPUT=...] -DNI_LD=... -DNI_OBJCOPY=... -DNI_READELF=... -DNI_AR=...
#   -P nanoinferElfArtifacts.cmake
#
# static: cargo's staticlib holds Rust's std, compiler_builtins and every
#   dependency as global symbols (~33k). compiler_builtins defines libm names
#   (sqrt, fmod, fma, ...) that the app's own calls then bind to (no errno), and
#   a second Rust staticlib defines the same std/builtins symbols, so linking
#   both with --whole-archive fails. The archive's objects are prelinked into
#   one relocatable object (ld -r) in which everything but the ni_* API is made
#   local (objcopy --keep-global-symbols): the library's internal references are
#   resolved inside that object and nothing else can collide or interpose.
# shared: the cdylib already exports only ni_*, but carries the release
#   profile's debug info (kept for profiling). It is stripped, and the debug
#   info goes to a separate file that the stripped library names in
#   .gnu_debuglink (gdb and perf look for it in the library's .debug/ folder).
cmake_minimum_required(VERSION 3.16)

foreach(_v NI_MODE NI_INPUT NI_OUTPUT NI_OBJCOPY)
  if(NOT ${_v})
    message(FATAL_ERROR "${_v} is not set")
  endif()
endforeach()

function(ni_run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc ERROR_VARIABLE _err OUTPUT_VARIABLE _out)
  if(NOT _rc EQUAL 0)
    string(REPLACE ";" " " _cmd "${ARGN}")
    message(FATAL_ERROR "${_cmd} failed (${_rc}):\n${_out}${_err}")
  endif()
endfunction()

get_filename_component(_outdir "${NI_OUTPUT}" DIRECTORY)
get_filename_component(_outname "${NI_OUTPUT}" NAME)

if(NI_MODE STREQUAL "static")
  foreach(_v NI_LD NI_READELF NI_AR)
    if(NOT ${_v})
      message(FATAL_ERROR "${_v} is not set")
    endif()
  endforeach()
  set(_work "${_outdir}/${_outname}.prelink")
  file(REMOVE_RECURSE "${_work}")
  file(MAKE_DIRECTORY "${_work}")
  # --force-group-allocation dissolves COMDAT groups (DW.ref.rust_eh_personality):
  # a group keeps its signature name after its symbol is made local, and the
  # final link would then keep only one of the same-named groups from this
  # library and another Rust library, leaving the other's references to a
  # local symbol it cannot see (or this one's to a discarded section).
  ni_run("${NI_LD}" -r --force-group-allocation -o "${_work}/prelinked.o"
         --whole-archive "${NI_INPUT}" --no-whole-archive)

  # The API is what the library defines as global ni_* functions, read from the
  # object itself so that the list follows the sources (the packaging test
  # checks it against the header). readelf, not nm: nm hands objects with
  # embedded LLVM bitcode to an installed LLVM gold plugin, which may fail on
  # them and report no symbols at all.
  execute_process(COMMAND "${NI_READELF}" -sW "${_work}/prelinked.o"
                  OUTPUT_FILE "${_work}/symbols.txt" RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${NI_READELF} -sW ${_work}/prelinked.o failed (${_rc})")
  endif()
  file(STRINGS "${_work}/symbols.txt" _lines REGEX " FUNC +GLOBAL +DEFAULT +[0-9]+ ni_[A-Za-z0-9_]+$")
  set(_api "")
  foreach(_line IN LISTS _lines)
    string(REGEX MATCH "ni_[A-Za-z0-9_]+$" _name "${_line}")
    list(APPEND _api "${_name}")
  endforeach()
  file(REMOVE "${_work}/symbols.txt")
  list(REMOVE_DUPLICATES _api)
  list(SORT _api)
  list(LENGTH _api _count)
  if(_count EQUAL 0)
    message(FATAL_ERROR "no global ni_* function in ${NI_INPUT}")
  endif()
  list(JOIN _api "\n" _keep)
  file(WRITE "${_work}/keep.txt" "${_keep}\n")

  # .llvmbc/.llvmcmd are the bitcode Rust's prebuilt std embeds for rustc's own
  # LTO; no C toolchain uses it, and it makes binutils' nm fail as above.
  ni_run("${NI_OBJCOPY}" "--keep-global-symbols=${_work}/keep.txt"
         --remove-section=.llvmbc --remove-section=.llvmcmd
         "${_work}/prelinked.o" "${_work}/nanoinfer.o")
  file(REMOVE "${_work}/prelinked.o" "${NI_OUTPUT}")
  ni_run("${NI_AR}" crs "${NI_OUTPUT}" "${_work}/nanoinfer.o")
  file(REMOVE "${_work}/nanoinfer.o")
  message(STATUS "${_outname}: one object, ${_count} global ni_* functions")
elseif(NI_MODE STREQUAL "shared")
  if(NOT NI_DEBUG_OUTPUT)
    message(FATAL_ERROR "NI_DEBUG_OUTPUT is not set")
  endif()
  get_filename_component(_dbgdir "${NI_DEBUG_OUTPUT}" DIRECTORY)
  file(MAKE_DIRECTORY "${_dbgdir}")
  file(REMOVE "${NI_OUTPUT}" "${NI_DEBUG_OUTPUT}")
  ni_run("${NI_OBJCOPY}" --only-keep-debug "${NI_INPUT}" "${NI_DEBUG_OUTPUT}")
  # The link records the debug file's name and CRC; the file must not change
  # after this.
  ni_run("${NI_OBJCOPY}" --strip-unneeded "--add-gnu-debuglink=${NI_DEBUG_OUTPUT}"
         "${NI_INPUT}" "${NI_OUTPUT}")
else()
  message(FATAL_ERROR "NI_MODE must be static or shared, not ${NI_MODE}")
endif()
