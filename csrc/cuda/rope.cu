#include "stagewise/rope.h"
namespace stagewise::cuda {}
