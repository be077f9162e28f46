# Whether NCCL's device-initiated networking (GIN) joins the ranks of a job, and what it moves
# (CUDA + NCCL builds only): build/gin_probe, run under `moe-echo launch -n N`. Needs NCCL 2.31 or
# later to do anything (it says so and exits 2 otherwise).
add_executable(gin_probe ${CMAKE_CURRENT_LIST_DIR}/gin_probe.cu)
target_include_directories(gin_probe SYSTEM PRIVATE ${MOE_ECHO_NCCL_INCLUDE_DIR})
target_link_libraries(gin_probe PRIVATE moe_echo ${MOE_ECHO_NCCL_LIBRARY} CUDA::cudart
                      nlohmann_json::nlohmann_json)
set_target_properties(gin_probe PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
                      CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}" CUDA_STANDARD 20)
target_compile_options(gin_probe PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)

# Whether the CPU can map GPU memory through DMA-BUF (what NCCL's socket GIN needs without
# GDRCopy's kernel module): build/dmabuf_probe, one process, no NCCL.
add_executable(dmabuf_probe ${CMAKE_CURRENT_LIST_DIR}/dmabuf_probe.cu)
target_link_libraries(dmabuf_probe PRIVATE CUDA::cuda_driver)
set_target_properties(dmabuf_probe PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
                      CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
