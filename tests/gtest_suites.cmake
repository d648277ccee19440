# Run by ctest (a TEST_INCLUDE_FILES script, tests/CMakeLists.txt): one ctest test per GoogleTest
# suite of `binary` (set by the includer), each running the suite's cases in one process: starting
# a process that loads LibTorch (about 0.8 s of a 2-core machine's CPU) costs as much as most cases.
execute_process(COMMAND "${binary}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status TIMEOUT 60)
if(NOT status EQUAL 0)
  # A test that fails and says why (build the target first, or it crashed listing its cases).
  add_test("${target}.ListingItsCases" "${binary}" --gtest_list_tests)
  return()
endif()
string(REPLACE "\n" ";" lines "${listing}")
foreach(line IN LISTS lines)
  # "Suite." or "Prefix/Suite/0.  # TypeParam = ..." start a suite; cases are indented.
  if(line MATCHES "^([^ ]+)\\.")
    add_test("${CMAKE_MATCH_1}" "${binary}" "--gtest_filter=${CMAKE_MATCH_1}.*")
  endif()
endforeach()
