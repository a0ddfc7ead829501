#include "stagewise/cache.h"
namespace stagewise::cuda {}
