# The ECHO planner's time per call on the host and on the GPU, GPU plans checked against the host
# plans (CUDA builds only): build/planner_bench.
add_executable(planner_bench ${CMAKE_CURRENT_LIST_DIR}/planner_bench.cpp)
target_link_libraries(planner_bench PRIVATE moe_echo moe_echo_offline CUDA::cudart
                                            nlohmann_json::nlohmann_json)
set_target_properties(planner_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
moe_echo_warnings(planner_bench)
