# Dispatch and combine of the NCCL communicator next to a captured ncclAlltoAll of the same bytes
# (CUDA + NCCL builds only): build/nccl_comm_bench, run under `moe-echo launch -n N`.
add_executable(nccl_comm_bench ${CMAKE_CURRENT_LIST_DIR}/nccl_comm_bench.cu)
target_include_directories(nccl_comm_bench SYSTEM PRIVATE ${MOE_ECHO_NCCL_INCLUDE_DIR})
target_link_libraries(nccl_comm_bench PRIVATE moe_echo_nccl nlohmann_json::nlohmann_json)
set_target_properties(nccl_comm_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
                      CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}" CUDA_STANDARD 20)
