#include "stagewise/norm.h"
namespace stagewise::cuda {}
