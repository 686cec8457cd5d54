// The attention's row loops on AVX-512 vectors. Compiled with -mavx512{f,bw,vl,dq} -mfma; only called when
// the dispatch's ISA has them.
#if defined(JB_X86)
#include "layers/attention/row_loops.h"
#include "layers/attention/simd.h"

namespace jb::attention {

detail::RowFns detail::rows_avx512() { return row_fns<Vector<simd::Avx512>>(); }

}  // namespace jb::attention
#endif
