# source-level ncu of the NVFP4 write alone and the rotary write (f32 half tables), 4096 tokens; head build in $KVFUSE_NATIVE_BUILD_DIR
for which in write rope; do
  skip=$([ $which = write ] && echo 14 || echo 21)
  timeout 90 ncu --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy --cache-control none --clock-control none \
    -k regex:rows_kernel --launch-skip $skip --launch-count 1 -f -o $R/rope_$which python3 .scratch/s29/ncu_rope.py nvfp4 4096 "f32 half" > $R/rope_$which.log 2>&1 || echo "ncu $which rc=$?"
  ncu -i $R/rope_$which.ncu-rep --page source --print-source sass --csv > $R/rope_${which}_sass.csv 2> $R/rope_${which}_sass.err
  ncu -i $R/rope_$which.ncu-rep --page details --csv > $R/rope_${which}_details.csv 2>&1
  gzip -f $R/rope_${which}_sass.csv
  echo "ncu rope $which ${SECONDS}s"
done
