// The attention's row loops on AVX2 vectors. Compiled with -mavx2 -mfma; only called when
// the dispatch's ISA has them.
#if defined(JB_X86)
#include "layers/attention/row_loops.h"
#include "layers/attention/simd.h"

namespace jb::attention {

detail::RowFns detail::rows_avx2() { return row_fns<Vector<simd::Avx2>>(); }

}  // namespace jb::attention
#endif
