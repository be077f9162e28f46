# The grouped GEMM benchmark (CUDA builds only): build/grouped_gemm_bench.
# -DMOE_ECHO_GEMM_VARIANTS=ON also compiles alternative CUTLASS configurations into it (one
# object per configuration, ~80 s each on two cores: off by default, meant for the GPU machine).
option(MOE_ECHO_GEMM_VARIANTS "Compile alternative grouped GEMM kernels into grouped_gemm_bench" OFF)
set(MOE_ECHO_GEMM_VARIANT_COUNT 7)

add_executable(grouped_gemm_bench ${CMAKE_CURRENT_LIST_DIR}/grouped_gemm_bench.cu)
set(moe_echo_gg_bench_targets grouped_gemm_bench)
if(MOE_ECHO_GEMM_VARIANTS)
  math(EXPR last "${MOE_ECHO_GEMM_VARIANT_COUNT} - 1")
  foreach(v RANGE ${last})
    add_library(grouped_gemm_bench_variant${v} OBJECT ${CMAKE_CURRENT_LIST_DIR}/grouped_gemm_bench.cu)
    target_compile_definitions(grouped_gemm_bench_variant${v} PRIVATE MOE_ECHO_GG_VARIANT=${v})
    target_sources(grouped_gemm_bench PRIVATE $<TARGET_OBJECTS:grouped_gemm_bench_variant${v}>)
    list(APPEND moe_echo_gg_bench_targets grouped_gemm_bench_variant${v})
  endforeach()
endif()
foreach(t ${moe_echo_gg_bench_targets})
  set_target_properties(${t} PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                                        CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  target_include_directories(${t} SYSTEM PRIVATE ${MOE_ECHO_CUTLASS_DIR}/include
                                                 ${MOE_ECHO_CUTLASS_DIR}/tools/util/include)
  target_compile_options(${t} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
endforeach()
target_link_libraries(grouped_gemm_bench PRIVATE moe_echo CUDA::cudart)
set_target_properties(grouped_gemm_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
