#include <c10/util/Exception.h>
#include "stagewise/rope.h"
namespace stagewise::cpu {
void rope(const RopeParams&) { TORCH_CHECK(false, "TODO"); }
void qk_norm_rope(const RopeParams&) { TORCH_CHECK(false, "TODO"); }
}
