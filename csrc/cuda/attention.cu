#include "stagewise/attention.h"
namespace stagewise::cuda {}
