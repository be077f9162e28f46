# Sourced by the multi-GPU scripts: finds NCCL with the device API (nccl_device.h) in $NCCL_ROOT,
# the nvidia-nccl Python package (the one PyTorch loads; the GPU machines have only that one) or
# the CUDA toolkit, in CMakeLists.txt's order, sets nccl_root and puts its library folder on
# LD_LIBRARY_PATH.
nccl_root=""
for d in ${NCCL_ROOT:-} \
         "$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)" \
         /usr/local/cuda; do
  if [ -n "$d" ] && [ -f "$d/include/nccl_device.h" ]; then nccl_root=$d; break; fi
done
for l in lib lib64; do
  [ -n "$nccl_root" ] && [ -f "$nccl_root/$l/libnccl.so.2" ] && export LD_LIBRARY_PATH="$nccl_root/$l:${LD_LIBRARY_PATH:-}"
done
echo "NCCL: ${nccl_root:-not found}"
