#include <c10/util/Exception.h>
#include "stagewise/cache.h"
namespace stagewise::cpu {
void reshape_and_cache(const ReshapeAndCacheParams&) { TORCH_CHECK(false, "TODO"); }
void slot_mapping(const SlotMappingParams&) { TORCH_CHECK(false, "TODO"); }
}
