// model_families(): the rows of families.h's list, built once.
#include "trainer/model/families/families.h"

namespace qtrain::trainer {

const std::vector<ModelFamily>& model_families() {
#define QTRAIN_FAMILY_ROW(name) name##_family(),
  static const std::vector<ModelFamily> families = {QTRAIN_MODEL_FAMILIES(QTRAIN_FAMILY_ROW)};
#undef QTRAIN_FAMILY_ROW
  return families;
}

}  // namespace qtrain::trainer
