# Peer copies beside a kernel that holds every SM: copy engine, SM copy kernels, conditional-body
# memcpys (CUDA builds only; needs 2 GPUs to run): build/ce_overlap_probe.
add_executable(ce_overlap_probe ${CMAKE_CURRENT_LIST_DIR}/ce_overlap_probe.cu)
target_link_libraries(ce_overlap_probe PRIVATE CUDA::cudart)
set_target_properties(ce_overlap_probe PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
                                                  CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
