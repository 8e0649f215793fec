// The CPU optimizer-step template, compiled once per ISA: each csrc/cpu/step_<isa>.cpp sets
// `#pragma GCC target`, defines QCONF_ISA_*, and includes this inside namespace qconf::isa_<isa>
// after simd.h (which defines the `Isa` traits the three parts use):
//
//   tile_codec.h     dtype loads/stores, packed codes, scale-layout walkers, dequantize, the
//                    generic quantize, absmax reductions
//   quantizer.h      the fast 4/8-bit quantizers (register tables, grid, octave lines) and the
//                    per-element scale fills and block scales
//   step_pipeline.h  one tile through load -> dequantize -> rule -> quantize -> store, the
//                    factor pass, and the per-ISA entry points run_items / run_codec_items
//
// Generic helpers they call (element.h, scale_walk.h) are included before the target pragma, so
// that every ISA build shares one definition of them.
#include "qconf/tile_codec.h"
#include "qconf/quantizer.h"
#include "qconf/step_pipeline.h"
