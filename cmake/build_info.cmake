# Writes build_info.h from build_info.h.in with the current git commit; run at every build, it
# rewrites the header only when the commit changed, so the binary always names its source.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SOURCE_DIR}
                OUTPUT_VARIABLE POLLEN_GIT_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT POLLEN_GIT_COMMIT)
  set(POLLEN_GIT_COMMIT unknown)
endif()
execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SOURCE_DIR}
                OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(dirty)
  string(APPEND POLLEN_GIT_COMMIT "-dirty")
endif()
configure_file(${SOURCE_DIR}/src/base/build_info.h.in ${OUTPUT}.tmp @ONLY)
file(COPY_FILE ${OUTPUT}.tmp ${OUTPUT} ONLY_IF_DIFFERENT)
