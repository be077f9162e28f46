# Two micro-batches of one layer on one GPU, one at a time, interleaved, and on two streams
# (CUDA builds only): build/micro_batch_bench.
add_executable(micro_batch_bench ${CMAKE_CURRENT_LIST_DIR}/micro_batch_bench.cpp)
target_link_libraries(micro_batch_bench PRIVATE moe_echo CUDA::cudart nlohmann_json::nlohmann_json)
set_target_properties(micro_batch_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
