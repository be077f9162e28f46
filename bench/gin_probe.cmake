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

# A test-only NCCL RMA plugin for the GIN probe: NCCL's GIN proxy between the processes of one
# host over CUDA IPC, for hosts without an InfiniBand NIC or GDRCopy (tests/gpu/gin_ipc; loaded
# with NCCL_RMA_PLUGIN=<build>/libmoe_echo_gin_ipc.so). Needs no NCCL to build.
add_library(moe_echo_gin_ipc SHARED ${PROJECT_SOURCE_DIR}/tests/gpu/gin_ipc/gin_ipc_rma.cpp)
target_link_libraries(moe_echo_gin_ipc PRIVATE CUDA::cuda_driver CUDA::cudart)
set_target_properties(moe_echo_gin_ipc PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
                      CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON CXX_VISIBILITY_PRESET hidden)
# NCCL may dlclose the plugin while its GIN proxy still holds the function table: stay loaded.
target_link_options(moe_echo_gin_ipc PRIVATE -Wl,-z,nodelete)
moe_echo_warnings(moe_echo_gin_ipc)
add_dependencies(gin_probe moe_echo_gin_ipc)
