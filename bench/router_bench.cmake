# The router benchmark on one GPU (CUDA builds only): build/router_bench.
add_executable(router_bench ${CMAKE_CURRENT_LIST_DIR}/router_bench.cpp)
target_link_libraries(router_bench PRIVATE moe_echo CUDA::cudart nlohmann_json::nlohmann_json)
set_target_properties(router_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
