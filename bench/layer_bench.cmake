# The whole-layer benchmark on one GPU (CUDA builds only): build/layer_bench.
add_executable(layer_bench ${CMAKE_CURRENT_LIST_DIR}/layer_bench.cpp)
target_link_libraries(layer_bench PRIVATE moe_echo CUDA::cudart nlohmann_json::nlohmann_json)
set_target_properties(layer_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
